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
   (which D2 computes in its next step) goes through the connector's source half
   (``kv_transfer/connector/source.py``), the same as a prefill worker's: sender, layout check and checksums, into D2's blocks (those D2's prefix cache holds are
   skipped); then ``PrefillDone`` carrying that last token.
4. D2 verified the transfer: the stream is done here (blocks freed, ``finished``). The transfer failed,
   or D2 cancelled: it ends here too; D2 reports it and the router migrates it by replay.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

from kv_transfer.connector.source import KVSource, SourceStatus
from pipeline.protocol.cluster import HandoffOffer, PrefillDone, PrefillRequest, encode
from pipeline.tracing import NOOP_REQUEST_SPANS

logger = logging.getLogger(__name__)

REOFFER_AFTER_S = 1.0  # a declined stream decodes on here this long before it is offered again


class KVHandoff:
    """A draining worker's streams as the source half of the KV connector sees them: each paused stream is
    held (UNCLAIMED) while offered, claimed by its target's ``PrefillRequest``, shipped whole and finished
    at once, reaped when the target verified it (or dropped when cancelled)."""

    def __init__(self, worker_id: str, engine, open_source: Callable[[], KVSource],
                 spans=NOOP_REQUEST_SPANS) -> None:
        """``spans``: the worker's ``RequestSpans``; a stream's send becomes a span under its ``decode`` span."""
        self.worker_id = worker_id
        self.engine = engine
        self.spans = spans
        self._open_source = open_source  # bound on the first offer: a worker that never drains has none
        self.source: KVSource | None = None
        self._declined_at: dict[str, float] = {}  # streams the router declined, when

    @property
    def num_bad_frames(self) -> int:
        return self.source.num_bad_frames if self.source is not None else 0

    # ------------------------------------------------------------ offers
    def offer(self, link, stream_ids: list[str]) -> None:
        """Offer paused streams to the router (after their tokens on the same socket)."""
        if stream_ids and self.source is None:
            self.source = self._open_source()
        for stream_id in stream_ids:
            self.source.hold(stream_id)  # no hold deadline: the router declines, cancels or a target asks
            link.send(HandoffOffer(worker_id=self.worker_id, request_id=stream_id, endpoint=self.source.endpoint))

    def decline(self, stream_id: str) -> None:
        """No target: the stream decodes on here (and is offered again after ``REOFFER_AFTER_S``)."""
        transfer = self.source.get(stream_id) if self.source is not None else None
        if transfer is not None and transfer.status is SourceStatus.UNCLAIMED:
            self.source.release(stream_id)
            self._declined_at[stream_id] = time.monotonic()
            self.engine.kv.resume_paused(stream_id)

    def recently_declined(self) -> set[str]:
        """Streams not to pause and offer again yet."""
        now = time.monotonic()
        for stream_id, at in list(self._declined_at.items()):
            if now - at > REOFFER_AFTER_S or self.engine.get_sequence(stream_id) is None:
                del self._declined_at[stream_id]
        return set(self._declined_at)

    def owns(self, stream_id: str) -> bool:
        return self.source is not None and stream_id in self.source

    def cancel(self, stream_id: str) -> None:
        """The router ended the stream (client gone, deadline, or its handoff abandoned): free its blocks,
        once the sender lets go of them."""
        if self.owns(stream_id):
            self.source.drop(stream_id, "cancelled by the router")

    def has_work(self) -> bool:
        return self.source is not None and self.source.has_work()

    def unsent(self) -> list[str]:
        """Streams no target has asked for yet (the drain is over: the worker fails them, retryable)."""
        return [t.request_id for t in self.source.with_status(SourceStatus.UNCLAIMED)] if self.source else []

    # ------------------------------------------------------------ targets
    def progress(self) -> list[str]:
        """Answer targets' requests and reap finished sends; returns the streams that left (handed off or failed)."""
        if self.source is None:
            return []
        for identity, request in self.source.receive():
            self._send_kv(identity, request)
        left = []
        for transfer, status in self.source.reap():  # (the source freed their blocks)
            self.spans.transfer(transfer.request_id, "kv_transfer.send", "decode", status,
                                num_blocks=transfer.num_sent_blocks - transfer.num_skipped_blocks)
            if status.ok:
                logger.info("stream %s handed off with its KV (%d bytes, %.1f ms)", transfer.request_id,
                            status.num_bytes, status.seconds * 1e3)
            elif transfer.status is not SourceStatus.DROPPING:
                logger.warning("stream %s: KV handoff failed; the router migrates it by replay", transfer.request_id)
            left.append(transfer.request_id)
        return left

    def _send_kv(self, identity: bytes, request: PrefillRequest) -> None:
        stream_id = request.source_request_id or ""
        transfer = self.source.get(stream_id)
        seq = self.engine.get_sequence(stream_id)
        error = None
        if transfer is None or seq is None or transfer.status is not SourceStatus.UNCLAIMED:
            error = f"no paused stream {request.source_request_id!r} to hand off here"
        elif request.prompt_token_ids != seq.token_ids:
            error = "the tokens asked for are not this stream's"
        if error is not None:
            self.source.reject(identity, request.request_id, error, retryable=False)
            return
        self.source.claim(stream_id, identity, request, acknowledge=False)
        self.source.start(stream_id, ttl_s=math.inf)
        # the KV of every token but the last (which the target computes in its next step)
        self.source.finish(stream_id, encode(PrefillDone(
            request_id=request.request_id,
            first_token_id=seq.token_ids[-1],
            num_prompt_tokens=seq.num_prompt_tokens,
            prefill_worker_id=self.worker_id,
            num_draft_computed_tokens=seq.num_draft_computed_tokens if seq.speculates else None,
        )), upto_block=-(-(seq.num_tokens - 1) // self.engine.kv.page_size))

    def sockets(self) -> list:
        return [self.source.socket.socket] if self.source is not None else []

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
