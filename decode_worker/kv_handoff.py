"""Live migration on drain, the source side: a draining DecodeOnly worker hands each decoding stream,
with its KV, to another DecodeOnly worker the router picks, so no token is recomputed.

1. Each pass while draining, the worker pauses the streams that are decoding (``engine.pause_decoding``:
   a step in flight is read first) and, after their tokens, offers each to the router (``offer``:
   ``HandoffOffer`` with this worker's handoff endpoint, bound on the first offer).
2. The router declines (``decline``: the stream decodes on here, offered again ``REOFFER_AFTER_S`` later
   while the drain lasts, in case a worker to take it has come up) or sends
   the stream to a target D2 with the tokens sent so far. D2 reserves blocks and sends this socket a
   ``PrefillRequest`` naming the stream (``source_request_id``), as it would ask a prefill worker.
3. ``progress`` answers it: the tokens must be the paused stream's; the KV of every token but the last
   (which D2 computes in its next step) goes through the transfer service, the same sender, layout
   check and checksums as prefill -> decode, into D2's blocks (those D2's prefix cache holds are
   skipped); then ``PrefillDone`` carrying that last token.
4. D2 verified the transfer: the stream is done here (blocks freed, ``finished``). The transfer failed,
   or D2 cancelled: it ends here too; D2 reports it and the router migrates it by replay.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import zmq

from kv_transfer.sender import KVSender
from pipeline.endpoints import worker_bind_endpoint
from pipeline.protocol.cluster import (
    CancelPrefill,
    DecodeToPrefill,
    HandoffOffer,
    PrefillDone,
    PrefillRejected,
    PrefillRequest,
    PrefillStarted,
    decode_decode_to_prefill,
    encode,
)
from pipeline.protocol.typed_socket import TypedSocket

logger = logging.getLogger(__name__)

REOFFER_AFTER_S = 1.0  # a declined stream decodes on here this long before it is offered again


@dataclass
class _Handoff:
    stream_id: str  # the stream's request id on this worker
    transfer_id: str | None = None  # the target's request id (the transfer's), once it asked
    is_cancelled: bool = False  # the router cancelled it while the sender held its blocks


class KVHandoff:
    def __init__(self, worker_id: str, ctx: zmq.Context, engine, layout, config) -> None:
        self.worker_id = worker_id
        self.ctx = ctx
        self.engine = engine
        self.layout = layout
        self.config = config
        # Bound on the first offer: a worker that never drains has none.
        self.socket: TypedSocket[DecodeToPrefill] | None = None
        self.endpoint = ""
        self.sender: KVSender | None = None
        self._streams: dict[str, _Handoff] = {}  # paused streams by their id here
        self._by_transfer: dict[str, _Handoff] = {}
        self._declined_at: dict[str, float] = {}  # streams the router declined, when

    @property
    def num_bad_frames(self) -> int:
        return self.socket.num_bad_frames if self.socket is not None else 0

    # ------------------------------------------------------------ offers
    def offer(self, link, stream_ids: list[str]) -> None:
        """Offer paused streams to the router (after their tokens on the same socket)."""
        if stream_ids and self.socket is None:
            self._start()
        for stream_id in stream_ids:
            self._streams[stream_id] = _Handoff(stream_id)
            link.send(HandoffOffer(worker_id=self.worker_id, request_id=stream_id, endpoint=self.endpoint))

    def decline(self, stream_id: str) -> None:
        """No target: the stream decodes on here (and is offered again after ``REOFFER_AFTER_S``)."""
        handoff = self._streams.get(stream_id)
        if handoff is not None and handoff.transfer_id is None:
            del self._streams[stream_id]
            self._declined_at[stream_id] = time.monotonic()
            self.engine.resume_paused(stream_id)

    def recently_declined(self) -> set[str]:
        """Streams not to pause and offer again yet."""
        now = time.monotonic()
        for stream_id, at in list(self._declined_at.items()):
            if now - at > REOFFER_AFTER_S or self.engine.get_sequence(stream_id) is None:
                del self._declined_at[stream_id]
        return set(self._declined_at)

    def owns(self, stream_id: str) -> bool:
        return stream_id in self._streams

    def cancel(self, stream_id: str) -> None:
        """The router ended the stream (client gone, deadline, or its handoff abandoned): free its blocks,
        once the sender lets go of them."""
        handoff = self._streams.get(stream_id)
        if handoff is None:
            return
        if handoff.transfer_id is None:
            del self._streams[stream_id]
            self.engine.abort_request(stream_id)
        elif not handoff.is_cancelled:
            handoff.is_cancelled = True
            self.sender.abort(handoff.transfer_id)

    def has_work(self) -> bool:
        return bool(self._streams)

    def unsent(self) -> list[str]:
        """Streams no target has asked for yet (the drain is over: the worker fails them, retryable)."""
        return [h.stream_id for h in self._streams.values() if h.transfer_id is None]

    # ------------------------------------------------------------ targets
    def progress(self) -> list[str]:
        """Answer targets' requests and reap finished sends; returns the streams that left (handed off or failed)."""
        if self.socket is None:
            return []
        self._receive()
        left = []
        for status in self.sender.poll():
            handoff = self._by_transfer.pop(status.request_id, None)
            if handoff is None:
                continue
            del self._streams[handoff.stream_id]
            if status.ok:
                logger.info("stream %s handed off with its KV (%d bytes, %.1f ms)", handoff.stream_id,
                            status.num_bytes, status.seconds * 1e3)
            elif not handoff.is_cancelled:
                logger.warning("stream %s: KV handoff failed (%s); the router migrates it by replay",
                               handoff.stream_id, status.error)
            self.engine.abort_request(handoff.stream_id)  # frees its blocks: the sender has let go
            left.append(handoff.stream_id)
        return left

    def _receive(self) -> None:
        for message, identity, _ in self.socket.receive_ready():
            if isinstance(message, CancelPrefill):
                handoff = self._by_transfer.get(message.request_id)
                if handoff is not None:
                    self.cancel(handoff.stream_id)
            else:
                self._send_kv(identity, message)

    def _send_kv(self, identity: bytes, request: PrefillRequest) -> None:
        handoff = self._streams.get(request.source_request_id or "")
        seq = self.engine.get_sequence(request.source_request_id or "")
        error = None
        if handoff is None or seq is None or handoff.transfer_id is not None:
            error = f"no paused stream {request.source_request_id!r} to hand off here"
        elif request.prompt_token_ids != seq.token_ids:
            error = "the tokens asked for are not this stream's"
        if error is not None:
            self.socket.send(PrefillRejected(request_id=request.request_id, error=error), to=identity)
            return
        handoff.transfer_id = request.request_id
        self._by_transfer[request.request_id] = handoff
        self.socket.send(PrefillStarted(request_id=request.request_id), to=identity)
        page_size = self.engine.kv_manager.page_size
        first = request.num_cached_tokens // page_size  # blocks the target's prefix cache holds
        upto = min(-(-(seq.num_tokens - 1) // page_size), len(request.dst_block_ids))
        table = self.engine.kv_manager.block_table(seq.request_id)
        self.sender.send_blocks(request.request_id, request.transfer_endpoint, table[first:upto],
                                request.dst_block_ids[first:upto] if upto > first else [])
        self.sender.finish(request.request_id, encode(PrefillDone(
            request_id=request.request_id,
            first_token_id=seq.token_ids[-1],
            num_prompt_tokens=seq.num_prompt_tokens,
            prefill_worker_id=self.worker_id,
            num_draft_computed_tokens=seq.num_draft_computed_tokens if seq.speculates else None,
        )))

    # ------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        self.socket = TypedSocket(self.ctx, zmq.ROUTER, decode_decode_to_prefill, "handoff socket", logger=logger)
        self.endpoint = self.socket.bind(worker_bind_endpoint(self.config.zmq_endpoint_base, self.worker_id,
                                                              f"handoff-{os.getpid()}",
                                                              host=self.config.resolved_bind_host()))
        self.sender = KVSender(self.engine.kv_cache, self.layout, kernel_backend=self.config.kernel_backend,
                               name="kv-handoff")

    def sockets(self) -> list[zmq.Socket]:
        return [self.socket.socket] if self.socket is not None else []

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.socket is not None:
            self.socket.close()
