"""The one typed socket wrapper: every cluster socket's options set in one place, messages decoded by the
socket's tagged-union decoder, and a frame that fails to decode counted, logged (rate-limited) and dropped.

Every ZMQ socket a Tandem process opens comes from ``open_socket``, so socket options live here once, and
every cluster socket binds and connects through ``TypedSocket``, so security does too: once the process has
a cluster key (``pipeline.security``), a ``tcp://`` bind is a CURVE server guarded by the ZAP handler and a
``tcp://`` connect a CURVE client; an ``ipc://`` bind is owner-only. ``TypedSocket`` wraps one such socket
with the decode function of what it receives (``pipeline.protocol.cluster.decode_*``,
``pipeline.protocol.transfer.*_DECODER.decode``)::

    requests = TypedSocket(ctx, zmq.ROUTER, decode_decode_to_prefill, "prefill requests")
    endpoint = requests.bind(address)
    for got in requests.receive_ready():     # what waits now; bad frames dropped on the way
        ...  got.message, got.sender (the peer's routing id), got.data (raw frames)
    requests.send(PrefillAccepted(request_id=rid), to=got.sender)

A message is one msgpack header frame, after the peer's routing id on a ROUTER socket and before up to
``max_data_frames`` raw frames: KV bytes travel there, zero-copy, never inside msgpack. The wrapper owns
no thread; only the thread that owns its socket uses it (ZMQ sockets are not thread-safe), and other
threads may read ``num_bad_frames``. With a ``zmq.asyncio`` context, ``receive_async`` awaits a message.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Generic, Iterator, NamedTuple, TypeVar

import msgspec
import zmq

from pipeline.security import bind_securely, connect_securely

M = TypeVar("M")

_log = logging.getLogger(__name__)
_encoder = msgspec.msgpack.Encoder()
_NUM_LOGGED_FIRST = 10  # bad frames logged one by one; after these, every _LOG_EVERY-th
_LOG_EVERY = 1000


def open_socket(ctx: zmq.Context, kind: int, *, identity: str | bytes | None = None, sndhwm: int | None = None,
                rcvhwm: int | None = None, router_mandatory: bool = False,
                router_handover: bool = False) -> zmq.Socket:
    """A new socket of ``kind`` with the cluster's options. Linger is 0 (a closing process never waits on a
    peer that is gone; ``close`` may ask for a grace). ``identity``: the routing id a ROUTER sees. HWMs bound
    what queues for a slow or dead peer. ``router_mandatory``: a send to an unknown peer fails instead of
    vanishing; ``router_handover``: a peer that reconnects with a known id takes it over."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity.encode() if isinstance(identity, str) else identity)
    if sndhwm is not None:
        sock.setsockopt(zmq.SNDHWM, sndhwm)
    if rcvhwm is not None:
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
    if router_mandatory:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if router_handover:
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    return sock


class Received(NamedTuple, Generic[M]):
    """One good message: the decoded header, who sent it (ROUTER sockets) and the raw frames after it."""

    message: M
    sender: bytes | None  # the peer's routing id on a ROUTER socket; None on the others
    data: list  # frames after the header (``zmq.Frame`` on a zero-copy socket, else bytes)


class TypedSocket(Generic[M]):
    """A socket of ``kind`` (options as ``open_socket``'s) that receives what ``decode`` accepts.

    ``name`` says which socket it is in logs. ``on_bad_frame`` runs once per dropped frame (the process's
    own metric, e.g. a Prometheus counter's ``inc``); ``num_bad_frames`` counts them too. ``zero_copy``
    receives frames as ``zmq.Frame`` (decoded from their buffer, data left in place): the KV path.
    ``logger``: whose log the drops appear in (the owning module's).
    """

    def __init__(self, ctx: zmq.Context, kind: int, decode: Callable[[bytes | memoryview], M], name: str, *,
                 max_data_frames: int = 0, zero_copy: bool = False, on_bad_frame: Callable[[], object] | None = None,
                 logger: logging.Logger | None = None, **options) -> None:
        self.socket = open_socket(ctx, kind, **options)
        self.name = name
        self.num_bad_frames = 0
        self._decode = decode
        self._has_routing_id = kind == zmq.ROUTER
        self._max_data_frames = max_data_frames
        self._copy = not zero_copy
        self._on_bad_frame = on_bad_frame
        self._log = logger or _log
        self._peer: str | None = None  # the endpoint a connected socket talks to (for the log)

    # ---------------------------------------------------------------- endpoints
    def bind(self, endpoint: str) -> str:
        """Bind (CURVE server on ``tcp://`` with a cluster key; owner-only on ``ipc://``); returns the bound
        address (a port 0 or ``*`` resolved)."""
        bind_securely(self.socket, endpoint)
        return self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def connect(self, endpoint: str) -> None:
        """Connect (a CURVE client of the cluster's key on ``tcp://`` when the process has one)."""
        connect_securely(self.socket, endpoint)
        self._peer = endpoint

    def close(self, linger: int = 0) -> None:
        self.socket.close(linger=linger)

    # ---------------------------------------------------------------- sending
    def send(self, message: msgspec.Struct, *data, to: bytes | None = None, flags: int = 0,
             track: bool = False) -> zmq.MessageTracker | None:
        """Send ``message`` (to the peer ``to`` on a ROUTER), with ``data`` as raw frames after it (sent
        zero-copy; ``track`` returns the tracker that says when ZMQ let go of them). Errors are pyzmq's
        (``zmq.Again`` under ``zmq.NOBLOCK`` when the queue is full), also on an asyncio socket, which
        must send with ``zmq.NOBLOCK``."""
        return self.send_frames([_encoder.encode(message), *data], to=to, flags=flags, copy=not data, track=track)

    def send_frames(self, frames: list, *, to: bytes | None = None, flags: int = 0, copy: bool = True,
                    track: bool = False) -> zmq.MessageTracker | None:
        """Frames as they are: a message already encoded (forwarded), or a wake-up."""
        if to is not None:
            frames = [to, *frames]
        result = self.socket.send_multipart(frames, flags, copy=copy, track=track)
        if isinstance(result, asyncio.Future):  # zmq.asyncio: resolved already under NOBLOCK
            exc = result.exception() if result.done() else None  # (reading it marks it retrieved)
            if exc is not None:
                raise exc
            return None
        return result

    # ---------------------------------------------------------------- receiving
    def receive(self) -> Received[M] | None:
        """The next good message waiting, without blocking (bad frames on the way are dropped); None if none."""
        return next(self.receive_ready(), None)

    def receive_ready(self, limit: int | None = None) -> Iterator[Received[M]]:
        """Every good message waiting now, without blocking; at most ``limit`` frames read (bad ones too)."""
        num_read = 0
        while limit is None or num_read < limit:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=self._copy)
            except zmq.Again:
                return
            num_read += 1
            got = self._parse(frames)
            if got is not None:
                yield got

    async def receive_async(self) -> Received[M]:
        """The next good message (a ``zmq.asyncio`` socket)."""
        while True:
            got = self._parse(await self.socket.recv_multipart(copy=self._copy))
            if got is not None:
                return got

    def count_bad_frame(self, peer: bytes | str | None, why: str) -> None:
        """Count a dropped frame and log it (the first few, then one in ``_LOG_EVERY``); owners call it too,
        for messages that decode but fail their own checks."""
        self.num_bad_frames += 1
        if self._on_bad_frame is not None:
            self._on_bad_frame()
        count = self.num_bad_frames
        if count <= _NUM_LOGGED_FIRST or count % _LOG_EVERY == 0:
            who = repr(peer[:64]) if isinstance(peer, bytes) else peer or self._peer or "a peer"
            self._log.warning("%s: dropped a bad frame from %s (%d so far): %s", self.name, who, count, why)

    def _parse(self, frames: list) -> Received[M] | None:
        sender = None
        if self._has_routing_id:
            sender = frames[0] if self._copy else frames[0].bytes
            frames = frames[1:]
        if not frames or len(frames) > 1 + self._max_data_frames:
            most = f"1 to {1 + self._max_data_frames}" if self._max_data_frames else "1"
            self.count_bad_frame(sender, f"expected {most} message frames, got {len(frames)}")
            return None
        try:
            message = self._decode(frames[0] if self._copy else frames[0].buffer)
        except (msgspec.DecodeError, ValueError) as exc:  # ValidationError included; msgspec raises a plain
            self.count_bad_frame(sender, str(exc))          # UnicodeDecodeError for a string that is not UTF-8
            return None
        return Received(message, sender, frames[1:])
