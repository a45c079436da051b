"""KVSender: the prefill worker's half of the transfer service; ships blocks to decode workers.

One DEALER socket per receiver endpoint, handshake first. Per request, pieces go out in call order and
``Finish`` (checksum + payload) after the last one on the same socket. zmq: each piece is packed into a
reused buffer (``data_path.pack_piece``) and sent zero-copy as a raw frame. shm / cuda_ipc: the receiver's
cache (its /dev/shm file, its CUDA IPC handle) is opened once per endpoint and each piece is copied straight
into the granted destination blocks, then announced with a small ``Written`` header. Nothing waits forever:
no handshake reply, a full send queue or no acknowledgement for ``timeout_s`` fails the request.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import msgspec
import numpy as np
import torch
import zmq

from kernels import load_kernels
from kv_transfer.blocks import MAX_PIECE_BYTES, Piece, normalize_block_ids, normalize_layers, split_pieces
from kv_transfer.checksum import KVChecksum
from kv_transfer import cuda_ipc
from kv_transfer.data_path import PackBuffers, byte_pages, pack_piece, write_piece_in_place, write_piece_on_device
from kv_transfer.handshake import check_reply
from kv_transfer.interface import SendStatus, StatsBox, TransferStats
from kv_transfer.io_thread import IOThread
from kv_transfer.sender_peers import SEND_HWM, Peer, PeerTable
from kv_transfer.layout import check_kv_cache
from kv_transfer.process_identity import own_identity
from kv_transfer.shm import host_id
from pipeline.protocol.transfer import (
    IN_PLACE_TRANSPORTS, Begin, Blocks, Finish, FinishAck, Grant, Hello, HelloReply, KVLayout,
    Revoke, RevokeAck, SenderAbort, Written,
)

log = logging.getLogger(__name__)

_RETRY_S = 0.002  # back-off when a receiver's queue is full
_MAX_TOMBSTONES = 100_000
_IDLE_PEER_S = 300.0  # connections unused this long are closed; the next request handshakes again


@dataclass(eq=False)
class _Request:
    request_id: str
    gen: int  # which incarnation of request_id (ids may be reused after their status was polled)
    peer: Peer
    checksum: KVChecksum
    started: float
    last_progress: float
    ops: collections.deque = field(default_factory=collections.deque)  # Piece | bytes (finish payload)
    outbox: tuple | None = None  # ops[0] prepared: (header, raw data frames), sent once the socket takes them
    outbox_buffer: np.ndarray | None = None  # the pack buffer the outbox lives in, reused once ZMQ sent it
    is_started: bool = False  # in place (shm, cuda_ipc): Begin sent
    grant: set[int] | None = None  # in place: blocks the receiver allows us to write
    is_finishing: bool = False  # Finish sent, waiting for FinishAck


@dataclass
class _Active:  # caller side
    endpoint: str
    gen: int
    is_finished: bool = False


class KVSender(IOThread):
    """Sends blocks of ``kv_cache`` ``[num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim]``.

    ``timeout_s`` bounds every wait on a receiver (handshake, queue space, acknowledgement);
    ``max_piece_bytes`` is the unit of one message (zmq) or in-place write (shm, cuda_ipc): large enough to
    amortise per-message costs, small enough that the receiver lands pieces while later ones are still being
    sent. Up to ``SEND_HWM`` pieces queue per receiver, and their pack buffers are kept for reuse.
    """

    def __init__(
        self, kv_cache: torch.Tensor, layout: KVLayout, *, kernel_backend: str = "torch", timeout_s: float = 10.0,
        max_piece_bytes: int = MAX_PIECE_BYTES, num_torch_threads: int = 1, name: str = "kv-sender",
    ) -> None:
        check_kv_cache(kv_cache, layout)
        transports = tuple(t for t in layout.transports if t != "cuda_ipc" or cuda_ipc.can_export(kv_cache))
        if not transports:
            raise ValueError("transports: 'cuda_ipc' needs a kv_cache on a CUDA device")
        self.kv_cache = kv_cache
        self._pages = byte_pages(kv_cache)
        self.layout = msgspec.structs.replace(layout, transports=transports)
        self.timeout_s = timeout_s
        self.max_piece_bytes = max_piece_bytes
        self._buffers = PackBuffers(max_piece_bytes, max_free=SEND_HWM + 4)
        self._kernels = load_kernels(kernel_backend, str(kv_cache.device))
        self._results: collections.deque[tuple[int, SendStatus]] = collections.deque()
        self._active: dict[str, _Active] = {}  # caller side
        self._next_gen = 0
        self._requests: dict[str, _Request] = {}
        self._tombstones: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._stats = StatsBox()
        # Test hook: fn(request_id, tensor) runs after a piece was checksummed, on the packed bytes about
        # to travel (zmq) or on the first page that just landed in the receiver's cache (shm).
        self.corrupt_hook: Callable[[str, torch.Tensor], None] | None = None
        super().__init__(name, num_torch_threads)
        hello = Hello(layout=self.layout, host_id=host_id(), process=own_identity())
        self._peers = PeerTable(self.ctx, self.poller, hello, self.layout, kv_cache,
                                lambda: self._stats.count("num_bad_frames"), log)  # I/O thread only
        self._start()

    # ---- caller side ---------------------------------------------------------------------------

    def send_blocks(self, request_id: str, dst_endpoint: str, src_block_ids: Sequence[int] | torch.Tensor,
                    dst_block_ids: Sequence[int] | torch.Tensor, layers: slice | int | None = None) -> None:
        """Queue ``src_block_ids[i] -> dst_block_ids[i]`` for ``layers`` (None = all); returns at once.

        Call it as chunks (or layers) of the prompt finish; pieces land in call order. The blocks must
        hold their final KV (on GPU: the writing kernels completed) and stay untouched until ``poll()``
        reports the request. Empty lists just open the request (nothing to ship, only ``finish``).
        """
        src = normalize_block_ids(src_block_ids, self.kv_cache.shape[2], "src_block_ids")
        dst = normalize_block_ids(dst_block_ids, 1 << 62, "dst_block_ids")  # the receiver checks the range
        if len(src) != len(dst):
            raise ValueError(f"src_block_ids and dst_block_ids differ in length ({len(src)} != {len(dst)})")
        layer_start, layer_stop = normalize_layers(layers, self.layout.num_layers)
        active = self._active.get(request_id)
        if active is None:
            self._next_gen += 1
            active = self._active[request_id] = _Active(dst_endpoint, self._next_gen)
        elif active.endpoint != dst_endpoint:
            raise ValueError(f"request {request_id!r} is already being sent to {active.endpoint}")
        elif active.is_finished:
            raise ValueError(f"request {request_id!r}: send_blocks after finish")
        self._submit(self._cmd_send, request_id, active.gen, dst_endpoint,
                     split_pieces(layer_start, layer_stop, src, dst, self.layout.layer_block_bytes,
                                  self.max_piece_bytes))

    def finish(self, request_id: str, payload: bytes = b"") -> None:
        """Send the checksum and ``payload`` after every queued piece of ``request_id``."""
        active = self._active.get(request_id)
        if active is None or active.is_finished:
            raise ValueError(f"request {request_id!r}: finish needs an open request (call send_blocks first, "
                             "with empty lists if there is nothing to ship), once")
        active.is_finished = True
        self._submit(self._cmd_finish, request_id, active.gen, bytes(payload))

    def abort(self, request_id: str) -> None:
        """Stop sending ``request_id``; the receiver is told, and ``poll()`` reports it failed."""
        active = self._active.get(request_id)
        if active is not None:
            self._submit(self._cmd_abort, request_id, active.gen)

    def poll(self, timeout_s: float = 0.0) -> list[SendStatus]:
        """Requests finished since the last call (ok: the receiver verified them), each exactly once; with
        ``timeout_s`` > 0 it waits up to that long for the first one."""
        if timeout_s > 0:
            self._wait_for_results(lambda: bool(self._results), timeout_s)
        self._raise_if_failed()
        out = []
        while self._results:
            gen, status = self._results.popleft()
            active = self._active.get(status.request_id)
            if active is not None and active.gen == gen:
                del self._active[status.request_id]
            out.append(status)
        return out

    def stats(self) -> TransferStats:
        return self._stats.snapshot()

    def close(self) -> None:
        """Abort what is in flight (the receivers are told, best effort) and stop."""
        self._stop()

    def __enter__(self) -> "KVSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- I/O thread: commands ------------------------------------------------------------------

    def _setup(self) -> None:
        pass

    def _cmd_send(self, request_id: str, gen: int, endpoint: str, pieces: list[Piece]) -> None:
        req = self._requests.get(request_id)
        if req is None:
            if self._tombstones.get(request_id) == gen:
                return  # already failed; its status is on its way to the caller
            now = time.monotonic()
            try:
                peer = self._peers.get(endpoint, now)
            except zmq.ZMQError as exc:
                return self._report(request_id, gen, False, f"cannot connect to {endpoint!r}: {exc}")
            req = self._requests[request_id] = _Request(request_id, gen, peer, KVChecksum(self.layout.page_bytes),
                                                        now, now)
        if not req.ops:
            req.last_progress = time.monotonic()  # the receiver's clock starts when there is work
        req.ops.extend(pieces)

    def _cmd_finish(self, request_id: str, gen: int, payload: bytes) -> None:
        req = self._requests.get(request_id)
        if req is not None and req.gen == gen:
            if not req.ops:
                req.last_progress = time.monotonic()
            req.ops.append(payload)

    def _cmd_abort(self, request_id: str, gen: int) -> None:
        req = self._requests.get(request_id)
        if req is not None and req.gen == gen:
            # Queued behind our Hello, so even a receiver mid-handshake learns it (D frees its blocks now).
            self._send(req.peer, SenderAbort(request_id=request_id))
            self._complete(req, False, "aborted by sender")

    # ---- I/O thread: progress ------------------------------------------------------------------

    def _tick(self, now: float) -> float | None:
        """One op per request per round (fair), then timeouts; returns seconds until work is due."""
        for peer in [p for p in self._peers.all() if not p.is_ready and now - p.since > self.timeout_s]:
            self._stats.count("num_timeouts")
            self._fail_peer(peer, f"no handshake reply from {peer.endpoint} within {self.timeout_s}s "
                                  "(receiver dead or unreachable?)")
        busy = {req.peer.endpoint for req in self._requests.values()}
        for peer in [p for p in self._peers.all() if p.endpoint not in busy and now - p.last_used > _IDLE_PEER_S]:
            self._peers.close(peer, linger=0)  # a decode worker that went away: stop reconnecting to it
        due = [p.since + self.timeout_s - now for p in self._peers.all() if not p.is_ready]
        for req in list(self._requests.values()):
            if self._requests.get(req.request_id) is not req:
                continue  # ended earlier in this round
            try:
                stepped = self._step(req, now)
            except Exception as exc:  # e.g. a kernel error: fail this request, keep serving the others
                log.exception("KV sender: request %s failed", req.request_id)
                if self._requests.get(req.request_id) is req:
                    self._complete(req, False, f"sender error: {exc!r}")
                continue
            if stepped:
                due.append(0.0)
            elif req.ops or req.is_finishing:  # waiting on the receiver (not on the caller): bounded
                if now - req.last_progress > self.timeout_s:
                    self._stats.count("num_timeouts")
                    self._complete(req, False, f"receiver at {req.peer.endpoint} made no progress for "
                                               f"{self.timeout_s}s (dead, stuck or unreachable?)")
                    continue
                due.append(req.last_progress + self.timeout_s - now)
                if req.peer.blocked_until > now:
                    due.append(req.peer.blocked_until - now)
        return min(due, default=None)

    def _step(self, req: _Request, now: float) -> bool:
        """Move ``req`` one op forward; False when it must wait (handshake, grant, ack, full queue)."""
        peer = req.peer
        if not peer.is_ready or not req.ops or now < peer.blocked_until:
            return False
        if peer.transport in IN_PLACE_TRANSPORTS and req.grant is None:
            if not req.is_started:
                req.is_started = self._send(peer, Begin(request_id=req.request_id))
                if not req.is_started:
                    peer.blocked_until = now + _RETRY_S
            return False
        if req.outbox is None:
            op = req.ops[0]
            if isinstance(op, Piece):
                req.outbox = self._prepare_piece(req, op)
                if req.outbox is None:
                    return False
            else:
                checksum = req.checksum
                req.outbox = (Finish(request_id=req.request_id, num_bytes=checksum.num_bytes,
                                     checksum=checksum.value, payload=op), [])
        if not self._send(peer, *req.outbox, buffer=req.outbox_buffer):
            peer.blocked_until = now + _RETRY_S
            return False
        op = req.ops.popleft()
        req.outbox, req.outbox_buffer = None, None
        req.last_progress = time.monotonic()
        if not isinstance(op, Piece):
            req.is_finishing = True
        return True

    def _prepare_piece(self, req: _Request, piece: Piece) -> tuple | None:
        """Pack (zmq) or write in place (shm, cuda_ipc) one piece; returns the header that announces it and the
        raw frame that carries it (zmq)."""
        start = time.perf_counter()
        fields = dict(request_id=req.request_id, layer_start=piece.layer_start, layer_stop=piece.layer_stop,
                      dst_block_ids=piece.dst_block_ids, num_bytes=piece.num_bytes(self.layout.layer_block_bytes))
        if req.peer.transport == "zmq":
            packed, req.outbox_buffer = pack_piece(self._kernels, self.kv_cache, self._pages, piece, req.checksum,
                                                   self._buffers)
            if self.corrupt_hook is not None:
                self.corrupt_hook(req.request_id, torch.from_numpy(packed))
            prepared = (Blocks(**fields), [packed])
        else:
            outside = [b for b in piece.dst_block_ids if b not in req.grant]
            if outside:
                self._complete(req, False, f"blocks {outside[:8]} are outside the receiver's reservation")
                return None
            if time.monotonic() - self.inbox_read_at > self.timeout_s / 2:
                # this thread was stopped (SIGSTOP) or starved mid-round: the receiver may have revoked the grant
                # and, after timeout_s, reused the blocks; read its messages before writing into its memory
                return None
            peer, first = req.peer, (piece.layer_start, 0, piece.dst_block_ids[0])
            is_device = peer.transport == "cuda_ipc"
            if is_device:
                write_piece_on_device(self._kernels, self.kv_cache, peer.device_cache, piece, req.checksum)
            else:
                write_piece_in_place(self.kv_cache, self._pages, peer.shm_pages, piece, req.checksum)
            if self.corrupt_hook is not None:
                self.corrupt_hook(req.request_id, peer.device_cache[first].view(torch.uint8) if is_device
                                  else torch.from_numpy(peer.shm_pages[first]))
            prepared = (Written(**fields), [])
        self._stats.add_bytes(req.peer.transport, fields["num_bytes"], time.perf_counter() - start)
        return prepared

    def _send(self, peer: Peer, header, data: Sequence = (), buffer: np.ndarray | None = None) -> bool:
        """Queue ``header`` and its raw ``data`` frames without blocking; a pack ``buffer`` the data lives in
        is reused once ZMQ sent it."""
        try:
            tracker = peer.sock.send(header, *data, flags=zmq.NOBLOCK, track=buffer is not None)
        except zmq.Again:
            return False
        if buffer is not None:
            self._buffers.lend(buffer, tracker)
        return True

    # ---- I/O thread: replies -------------------------------------------------------------------

    def _on_readable(self, sock: zmq.Socket) -> None:
        peer = self._peers.of_socket(sock)
        while peer is not None and self._peers.is_open(peer):
            got = peer.sock.receive()  # (bad frames are counted into the stats and dropped on the way)
            if got is None:
                return
            msg = got.message
            if isinstance(msg, HelloReply):
                self._on_hello_reply(peer, msg)
                continue
            req = self._requests.get(msg.request_id)
            if req is not None and req.peer is not peer:
                req = None
            if isinstance(msg, Grant) and req is not None:
                req.grant, req.last_progress = set(msg.dst_block_ids), time.monotonic()
            elif isinstance(msg, FinishAck) and req is not None and req.is_finishing:
                self._complete(req, msg.ok, None if msg.ok else f"receiver: {msg.error}")
            elif isinstance(msg, Revoke):
                if req is not None:
                    self._complete(req, False, f"revoked by receiver: {msg.reason}")
                self._send(peer, RevokeAck(request_id=msg.request_id))  # we stopped

    def _on_hello_reply(self, peer: Peer, reply: HelloReply) -> None:
        if peer.is_ready:
            return
        error = check_reply(self.layout, peer.endpoint, reply, peer.offered)
        if error:
            self._stats.count("num_refused_handshakes")
            return self._fail_peer(peer, error)
        error = self._peers.open_transport(peer, reply)
        if not error:
            return
        rest = tuple(t for t in peer.offered if t != reply.transport)
        if reply.transport not in IN_PLACE_TRANSPORTS or not rest:
            return self._fail_peer(peer, error)
        log.warning("KV sender: %s; handshaking again with %s", error, ", ".join(rest))
        self._stats.count("num_transport_fallbacks")
        try:
            self._peers.rehandshake(peer, rest)
        except zmq.ZMQError as exc:
            self._fail_peer(peer, f"{error}; could not handshake again: {exc}")

    # ---- I/O thread: ending --------------------------------------------------------------------

    def _fail_peer(self, peer: Peer, error: str) -> None:
        """Fail every request on ``peer`` and drop the connection (a later request handshakes again)."""
        log.warning("KV sender: %s", error)
        for req in [r for r in self._requests.values() if r.peer is peer]:
            self._complete(req, False, error)
        self._peers.close(peer, linger=0)

    def _complete(self, req: _Request, ok: bool, error: str | None) -> None:
        del self._requests[req.request_id]
        self._tombstones[req.request_id] = req.gen
        while len(self._tombstones) > _MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)
        seconds = time.monotonic() - req.started
        self._stats.end_transfer(req.peer.transport, ok, seconds)
        self._report(req.request_id, req.gen, ok, error, req.checksum.num_bytes, req.peer.transport, seconds)

    def _report(self, request_id: str, gen: int, ok: bool, error: str | None, num_bytes: int = 0,
                transport: str = "", seconds: float = 0.0) -> None:
        self._tombstones[request_id] = gen
        self._results.append((gen, SendStatus(request_id, ok, error, num_bytes, transport, seconds)))
        self._reported.set()

    def _teardown(self) -> None:
        for req in list(self._requests.values()):  # best effort: D should not wait for its TTL
            self._send(req.peer, SenderAbort(request_id=req.request_id, reason="sender closed"))
        for peer in self._peers.all():
            self._peers.close(peer, linger=200 if any(r.peer is peer for r in self._requests.values()) else 0)
