"""KVReceiver: the decode worker's half of the transfer service; KV lands in reserved blocks only.

Safety rule: bytes of a request are written only into blocks reserved for it by ``expect``, only while
that reservation is open, and only by the sender that first spoke for it. After ``abort`` (or any
failure) nothing more is written: ZMQ pieces are dropped unread; an in-place writer (shm, cuda_ipc) is told to stop
(``Revoke``) and the failure is reported only once it confirmed (``RevokeAck`` / ``Finish``) or stayed
silent for ``timeout_s``, or its process has exited (same host: ``process_identity``). So D may reuse a request's
blocks as soon as ``poll()`` has reported it.
"""

from __future__ import annotations

import collections
import logging
import socket
import time
from dataclasses import dataclass
from typing import Sequence
from urllib.parse import urlsplit

import msgspec
import torch
import zmq

from kernels import load_kernels
from kv_transfer import cuda_ipc
from kv_transfer.blocks import check_piece, normalize_block_ids
from kv_transfer.checksum import KVChecksum
from kv_transfer.data_path import byte_pages, land_piece
from kv_transfer.handshake import negotiate
from kv_transfer.interface import ReceivedTransfer, StatsBox, TransferStats
from kv_transfer.io_thread import IOThread
from kv_transfer.layout import check_kv_cache
from kv_transfer.process_identity import has_exited
from kv_transfer.shm import free_shared_kv_cache, host_id, shared_kv_path
from pipeline.protocol.transfer import (
    IN_PLACE_TRANSPORTS, SENDER_FRAME_DECODER, Begin, Blocks, Finish, FinishAck, Grant, Hello,
    HelloReply, KVLayout, Revoke, RevokeAck, SenderAbort, SenderFrame, Written,
)
from pipeline.protocol.typed_socket import TypedSocket

log = logging.getLogger(__name__)

_MAX_TOMBSTONES = 100_000  # ids of ended requests remembered, to tell "late" from "unknown"
_RECV_BATCH = 64  # messages per wake-up before commands (expect / abort) run again
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")
_WRITER_CHECK_S = 0.2  # how often a revoked in-place writer's process is looked at while it has not confirmed


@dataclass(eq=False)
class _Reservation:
    request_id: str
    dst_block_ids: list[int]
    allowed: set[int]
    expected_bytes: int | None
    checksum: KVChecksum
    created: float
    sender: bytes | None = None  # ZMQ identity of the one sender allowed to fill it
    transport: str = ""
    granted: bool = False  # in place (shm, cuda_ipc): the sender may be writing into our blocks right now
    revoking: str | None = None  # the error, while waiting for an in-place writer to confirm it stopped
    revoke_deadline: float = 0.0


@dataclass
class _Peer:
    ok: bool
    transport: str = ""
    error: str = ""
    process: str = ""  # the sender's process identity (Hello.process)


class KVReceiver(IOThread):
    """Receives KV blocks into ``kv_cache`` ``[num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim]``.

    ``bind`` is a ZMQ address (``tcp://host:port``, port 0 or ``*`` for any; ``ipc:///path``); senders
    connect to ``endpoint``. The shm transport is offered when ``kv_cache`` comes from
    ``allocate_shared_kv_cache`` and the layout allows it (``close()`` then removes that file), cuda_ipc when
    ``kv_cache`` is one CUDA tensor.
    """

    def __init__(
        self, kv_cache: torch.Tensor, layout: KVLayout, bind: str, *, kernel_backend: str = "torch",
        advertise_host: str | None = None, timeout_s: float = 10.0, num_torch_threads: int = 1,
        name: str = "kv-receiver",
    ) -> None:
        check_kv_cache(kv_cache, layout)
        self._shm_path = shared_kv_path(kv_cache)
        self._cuda_ipc_handle = cuda_ipc.export_or_none(kv_cache) if "cuda_ipc" in layout.transports else None
        can_open = {"shm": bool(self._shm_path), "cuda_ipc": self._cuda_ipc_handle is not None, "zmq": True}
        transports = tuple(t for t in layout.transports if can_open[t])
        if not transports:
            raise ValueError(f"transports: {layout.transports} need a kv_cache from allocate_shared_kv_cache ('shm') "
                             "or on a CUDA device ('cuda_ipc')")
        self.layout = msgspec.structs.replace(layout, transports=transports)
        self.kv_cache = kv_cache
        self._pages = byte_pages(kv_cache)
        self.timeout_s = timeout_s
        self._kernels = load_kernels(kernel_backend, str(kv_cache.device))
        self._num_blocks = kv_cache.shape[2]
        self._host_id = host_id()
        self._bind, self._advertise_host = bind, advertise_host
        self._endpoint = ""
        self._results: collections.deque[ReceivedTransfer] = collections.deque()
        self._open: set[str] = set()  # caller side: expected and not yet reported
        # written by the I/O thread, read by the caller (one dict operation each side: atomic)
        self._last_landed: dict[str, float] = {}  # request id -> when a piece of it last landed (monotonic)
        self._reservations: dict[str, _Reservation] = {}  # I/O thread from here on
        self._peers: dict[bytes, _Peer] = {}
        self._tombstones: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._stats = StatsBox()
        self._num_unknown_requests = 0  # frames for requests never reserved here (logged rate-limited)
        super().__init__(name, num_torch_threads)
        self._start()

    # ---- caller side ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The address senders connect to (put it in PrefillRequest)."""
        return self._endpoint

    def expect(self, request_id: str, dst_block_ids: Sequence[int] | torch.Tensor, num_bytes: int | None = None) -> None:
        """Reserve ``dst_block_ids`` for ``request_id``; ``num_bytes``, if given, is checked at finish.

        Request ids must be unique per attempt (a retry gets a new id).
        """
        ids = normalize_block_ids(dst_block_ids, self._num_blocks, "dst_block_ids")
        if request_id in self._open:
            raise ValueError(f"request_id: {request_id!r} already has an open reservation")
        self._open.add(request_id)
        self._submit(self._cmd_expect, request_id, ids, num_bytes, time.monotonic())

    def poll(self, timeout_s: float = 0.0) -> list[ReceivedTransfer]:
        """Requests the receiver is done with since the last call, each reported exactly once; with
        ``timeout_s`` > 0 it waits up to that long for the first one (instead of a sleep loop)."""
        if timeout_s > 0:
            self._wait_for_results(lambda: bool(self._results), timeout_s)
        self._raise_if_failed()
        out = []
        while self._results:
            out.append(self._results.popleft())
        for result in out:
            self._open.discard(result.request_id)
        return out

    def last_landed(self, request_id: str) -> float | None:
        """When a piece of ``request_id``'s KV last landed here (``time.monotonic``); None before the first piece
        or once it ended. The sink's TTL runs from it."""
        return self._last_landed.get(request_id)

    def abort(self, request_id: str) -> None:
        """Drop the reservation; ``poll()`` reports it (ok=False) once no byte can land any more."""
        if request_id in self._open:
            self._submit(self._cmd_abort, request_id)

    def stats(self) -> TransferStats:
        return self._stats.snapshot()

    def close(self) -> None:
        self._stop()
        if self._shm_path:
            free_shared_kv_cache(self.kv_cache)

    def __enter__(self) -> "KVReceiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- I/O thread: lifecycle -----------------------------------------------------------------

    def _setup(self) -> None:
        # A Blocks header carries one raw data frame; pieces are <= 4 MiB: RCVHWM bounds what queues in memory.
        self._sock: TypedSocket[SenderFrame] = TypedSocket(
            self.ctx, zmq.ROUTER, SENDER_FRAME_DECODER.decode, "KV receiver", max_data_frames=1, zero_copy=True,
            on_bad_frame=lambda: self._stats.count("num_bad_frames"), logger=log, rcvhwm=64)
        self._endpoint = self._advertised(self._sock.bind(self._bind))
        self.poller.register(self._sock.socket, zmq.POLLIN)

    def _advertised(self, bound: str) -> str:
        parts = urlsplit(bound)
        if parts.scheme != "tcp" or parts.hostname not in _WILDCARD_HOSTS:
            return bound
        host = self._advertise_host or socket.gethostbyname(socket.gethostname())
        return f"tcp://{host}:{parts.port}"

    def _teardown(self) -> None:
        sock = getattr(self, "_sock", None)
        if sock is None:
            return
        for res in self._reservations.values():  # tell live senders now rather than at their timeout
            if res.sender is not None:
                self._send(res.sender, Revoke(request_id=res.request_id, reason="receiver closed"))
        sock.close(linger=200 if self._reservations else 0)

    def _tick(self, now: float) -> float | None:
        waiting = [r for r in self._reservations.values() if r.revoking is not None]
        for res in waiting:
            if self._writer_exited(res):  # SIGKILLed mid-transfer: no acknowledgement will come, no byte either
                log.info("request %s: the in-place writer's process has exited; releasing", res.request_id)
                self._release(res, f"{res.revoking} (writer exited)")
            elif now >= res.revoke_deadline:
                self._stats.count("num_timeouts")
                log.warning("request %s: in-place writer did not confirm it stopped within %.1fs; releasing",
                            res.request_id, self.timeout_s)
                self._release(res, f"{res.revoking} (writer silent for {self.timeout_s}s)")
        due = min((r.revoke_deadline - now for r in self._reservations.values() if r.revoking), default=None)
        return None if due is None else min(due, _WRITER_CHECK_S)

    def _writer_exited(self, res: _Reservation) -> bool:
        peer = self._peers.get(res.sender) if res.sender is not None else None
        return peer is not None and bool(peer.process) and has_exited(peer.process)

    # ---- I/O thread: commands ------------------------------------------------------------------

    def _cmd_expect(self, request_id: str, ids: list[int], num_bytes: int | None, created: float) -> None:
        self._tombstones.pop(request_id, None)
        self._reservations[request_id] = _Reservation(
            request_id, ids, set(ids), num_bytes, KVChecksum(self.layout.page_bytes), created
        )

    def _cmd_abort(self, request_id: str) -> None:
        res = self._reservations.get(request_id)
        if res is not None and res.revoking is None:
            self._terminate(res, "aborted by receiver")

    # ---- I/O thread: messages ------------------------------------------------------------------

    def _on_readable(self, sock: zmq.Socket) -> None:
        for msg, identity, data in self._sock.receive_ready(limit=_RECV_BATCH):
            self._run_commands()  # an expect() issued before these bytes were sent must be in place
            try:
                self._handle(identity, msg, data)
            except Exception as exc:  # one bad message must not stop the service
                log.exception("KV receiver: error while handling a message")
                self._sock.count_bad_frame(identity, f"handler error ({exc!r})")

    def _handle(self, identity: bytes, msg: SenderFrame, data: list[zmq.Frame]) -> None:
        if len(data) != (1 if isinstance(msg, Blocks) else 0):
            return self._sock.count_bad_frame(identity, f"{type(msg).__name__} with {len(data)} data frames")
        if isinstance(msg, Hello):
            return self._on_hello(identity, msg)
        peer = self._peers.get(identity)
        if peer is None or not peer.ok:
            reason = peer.error if peer else "no handshake with this sender (receiver restarted?)"
            self._count_late()
            if not isinstance(msg, RevokeAck):
                self._send(identity, Revoke(request_id=msg.request_id, reason=reason))
            return
        if isinstance(msg, RevokeAck):
            res = self._reservations.get(msg.request_id)
            if res is not None and res.revoking is not None and res.sender == identity:
                self._release(res, res.revoking)
            return
        res = self._claim(identity, peer, msg)
        if res is None:
            return
        if isinstance(msg, Finish):
            self._on_finish(identity, res, msg)
        elif isinstance(msg, SenderAbort):
            self._release(res, f"aborted by sender: {msg.reason}" if msg.reason else "aborted by sender")
        elif res.revoking is not None:
            self._count_late()  # the writer has not seen our Revoke yet
        elif isinstance(msg, Begin):
            if peer.transport not in IN_PLACE_TRANSPORTS:
                return self._terminate(res, f"protocol error: Begin on a {peer.transport} connection")
            res.granted = True
            self._send(identity, Grant(request_id=res.request_id, dst_block_ids=res.dst_block_ids))
        else:
            self._on_piece(res, peer, msg, data[0].buffer if data else None)

    def _on_hello(self, identity: bytes, hello: Hello) -> None:
        transport, error = negotiate(self.layout, hello, self._host_id)
        if error:
            log.warning("refused KV transfer handshake from sender %s: %s", identity.hex(), error)
            self._stats.count("num_refused_handshakes")
            self._peers[identity] = _Peer(ok=False, error=f"handshake refused: {error}")
            self._send(identity, HelloReply(ok=False, error=error, layout=self.layout, host_id=self._host_id))
            return
        self._peers[identity] = _Peer(ok=True, transport=transport, process=hello.process)
        log.info("KV sender %s: handshake accepted, transport %s", identity.hex(), transport)
        if hello.layout.tensor_parallel_size != self.layout.tensor_parallel_size:
            log.info("KV from sender %s (%d tensor-parallel ranks) to this receiver (%d): the full-head layout "
                     "travels, each end re-slices for its own ranks", identity.hex(),
                     hello.layout.tensor_parallel_size, self.layout.tensor_parallel_size)
        self._send(identity, HelloReply(
            ok=True, layout=self.layout, host_id=self._host_id, transport=transport,
            shm_path=self._shm_path if transport == "shm" else "",
            num_blocks=self._num_blocks if transport in IN_PLACE_TRANSPORTS else 0,
            cuda_ipc=self._cuda_ipc_handle if transport == "cuda_ipc" else None,
        ))

    def _claim(self, identity: bytes, peer: _Peer, msg) -> _Reservation | None:
        """The open reservation ``msg`` is for, bound to its first sender; None (and the sender told) if none."""
        res = self._reservations.get(msg.request_id)
        if res is not None and res.sender is None:
            res.sender, res.transport = identity, peer.transport
        if res is not None and res.sender == identity:
            return res
        if res is not None:
            reason = "request is being sent by another sender"
        else:
            reason = self._tombstones.get(msg.request_id)
            if reason is None and isinstance(msg, SenderAbort):
                return None  # P gave up on a request this receiver never had: nothing to report
            if reason is None:  # never expected here: report once, then treat as ended
                reason = f"unknown request {msg.request_id!r} (no reservation on this receiver)"
                self._num_unknown_requests += 1
                if self._num_unknown_requests <= 10 or self._num_unknown_requests % 1000 == 0:  # a flood: one line
                    log.warning("KV transfer: %s (%d so far)", reason, self._num_unknown_requests)
                self._emit(ReceivedTransfer(msg.request_id, ok=False, error=reason, transport=peer.transport))
                self._tombstone(msg.request_id, reason)
        self._count_late()
        if isinstance(msg, Finish):
            self._send(identity, FinishAck(request_id=msg.request_id, ok=False, error=reason))
        elif not isinstance(msg, SenderAbort):
            self._send(identity, Revoke(request_id=msg.request_id, reason=reason))
        return None

    def _on_piece(self, res: _Reservation, peer: _Peer, msg: Blocks | Written, frame: memoryview | None) -> None:
        expected_kind = Blocks if peer.transport == "zmq" else Written
        if not isinstance(msg, expected_kind):
            return self._terminate(res, f"protocol error: {type(msg).__name__} on a {peer.transport} connection")
        if isinstance(msg, Written) and not res.granted:
            return self._terminate(res, "protocol error: Written before Grant")
        error = check_piece(self.layout, res.allowed, msg, None if frame is None else frame.nbytes)
        if error is not None:
            log.warning("request %s: %s", res.request_id, error)
            return self._terminate(res, error)
        start = time.perf_counter()
        land_piece(self._kernels, self.kv_cache, self._pages, msg.dst_block_ids,
                   slice(msg.layer_start, msg.layer_stop), frame, res.checksum)
        self._stats.add_bytes(res.transport, msg.num_bytes, time.perf_counter() - start)
        self._last_landed[res.request_id] = time.monotonic()

    def _on_finish(self, identity: bytes, res: _Reservation, msg: Finish) -> None:
        if res.revoking is not None:  # Finish comes after the writer's last write: it has stopped
            self._send(identity, FinishAck(request_id=res.request_id, ok=False, error=res.revoking))
            return self._release(res, res.revoking)
        landed = res.checksum.num_bytes
        error = None
        if res.expected_bytes is not None and landed != res.expected_bytes:
            error = f"size mismatch: expected {res.expected_bytes} bytes, {landed} landed"
        elif msg.num_bytes != landed:
            error = f"size mismatch: sender sent {msg.num_bytes} bytes, {landed} landed"
        elif msg.checksum != res.checksum.value:
            error = f"checksum mismatch: sender {msg.checksum:#018x}, landed {res.checksum.value:#018x}"
            self._stats.count("num_checksum_mismatches")
        if error:
            log.warning("request %s: %s", res.request_id, error)
        self._send(identity, FinishAck(request_id=res.request_id, ok=error is None, error=error or ""))
        self._end(res, error, msg.payload)

    # ---- I/O thread: ending requests -----------------------------------------------------------

    def _terminate(self, res: _Reservation, error: str) -> None:
        """Fail ``res``: tell its sender to stop; wait for an in-place writer to confirm before reporting."""
        if res.sender is not None:
            self._send(res.sender, Revoke(request_id=res.request_id, reason=error))
        if res.transport in IN_PLACE_TRANSPORTS and res.granted:
            res.revoking, res.revoke_deadline = error, time.monotonic() + self.timeout_s
        else:
            self._release(res, error)

    def _release(self, res: _Reservation, error: str) -> None:
        self._end(res, error, b"")

    def _end(self, res: _Reservation, error: str | None, payload: bytes) -> None:
        del self._reservations[res.request_id]
        self._last_landed.pop(res.request_id, None)
        self._tombstone(res.request_id, error or "request already finished")
        seconds = time.monotonic() - res.created
        self._stats.end_transfer(res.transport, error is None, seconds)
        self._emit(ReceivedTransfer(res.request_id, ok=error is None, error=error, payload=payload,
                                    num_bytes=res.checksum.num_bytes, transport=res.transport, seconds=seconds))

    def _emit(self, result: ReceivedTransfer) -> None:
        self._results.append(result)
        self._reported.set()

    def _tombstone(self, request_id: str, reason: str) -> None:
        self._tombstones[request_id] = reason
        while len(self._tombstones) > _MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _send(self, identity: bytes, msg) -> None:
        try:
            self._sock.send(msg, to=identity, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a ROUTER drops replies to unknown peers; anything else we log
            log.warning("KV receiver: could not send %s to %s: %s", type(msg).__name__, identity.hex(), exc)

    def _count_late(self) -> None:
        self._stats.count("num_late_dropped")
