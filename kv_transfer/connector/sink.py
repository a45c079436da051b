"""The sink half of the KV connector: a decode worker's requests whose KV another worker sends (a remote
prefill, or a live-migrated stream from a draining worker), one record per request.

A request walks (``SinkStatus``; vLLM's WAITING_FOR_REMOTE_KVS, SGLang's prealloc -> transfer queues)::

    WAITING_FOR_BLOCKS ──reserve──▶ REQUESTED ──PrefillAccepted──▶ QUEUED_AT_SOURCE
                                        │  └──────PrefillStarted──────▶ TRANSFERRING ◀─┘
                                        ▼ done (verified)                    │
              (gone: decoding)  or  ARRIVED (a migrated stream, until its first delta reports the bytes)
    REQUESTED / QUEUED_AT_SOURCE / TRANSFERRING ──tear_down──▶ ABORTING ──the receiver lets go──▶ (gone)

- ``expect``: the engine queued the request for a reservation (``WAITING_FOR_BLOCKS``).
- ``progress``: the engine reserves blocks (prefix blocks it holds are reused and skipped by the source);
  the receiver expects them (exactly the bytes ``sliding_window.planned_bytes`` says: a sliding-window layer's
  blocks outside the window are not sent, and such a request's blocks are withheld from the prefix cache)
  and the source gets a ``PrefillRequest`` (``REQUESTED``, TTL running until it
  answers). ``PrefillAccepted`` stops the TTL (queued there: load, not a fault); ``PrefillStarted`` starts it
  again for the prefill and the transfer, and every piece of KV that lands starts it again. The receiver's
  verdict activates the request in the engine (its first token, or nothing for a migrated stream) or fails it.
- ``expire`` (TTL) and ``tear_down`` (cancel, request deadline, rejection): the receiver stops expecting and
  the source is told; the blocks are freed only when the receiver reports it will never write them again.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from kv_transfer.connector.engine_port import SinkEngine
from kv_transfer.connector.source_links import SourceLinks
from kv_transfer.sliding_window import leaves_blocks_incomplete, planned_bytes
from pipeline.protocol.cluster import (
    CancelPrefill,
    GenerateRequest,
    PrefillAccepted,
    PrefillRequest,
    PrefillStarted,
    decode_prefill_done,
)

logger = logging.getLogger(__name__)


class SinkStatus(enum.Enum):
    WAITING_FOR_BLOCKS = "waiting_for_blocks"  # queued in the engine for a reservation
    REQUESTED = "requested"  # blocks reserved and expected, PrefillRequest sent; TTL until the source answers
    QUEUED_AT_SOURCE = "queued_at_source"  # the source accepted it: no TTL (its queue is load)
    TRANSFERRING = "transferring"  # the source started it: TTL from the start, then from each piece landed
    ABORTING = "aborting"  # torn down; gone once the receiver lets go of its blocks
    ARRIVED = "arrived"  # a migrated stream decoding here; kept until its first delta reports the KV bytes


IN_FLIGHT = (SinkStatus.REQUESTED, SinkStatus.QUEUED_AT_SOURCE, SinkStatus.TRANSFERRING, SinkStatus.ABORTING)


@dataclass
class SinkTransfer:
    """One request whose KV comes from another worker."""

    request: GenerateRequest  # its prefill_endpoint is the source; kv_source_request_id: a migrated stream
    status: SinkStatus = SinkStatus.WAITING_FOR_BLOCKS
    ttl_deadline: float = math.inf
    failure: str | None = None  # why it is being torn down (reported once the receiver lets go)
    retryable: bool = True
    num_migrated_bytes: int = 0  # ARRIVED: the KV bytes that came, for its first delta

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def is_migration(self) -> bool:
        return self.request.kv_source_request_id is not None


@dataclass
class SinkEvent:
    """What ``progress`` tells the worker about a request: its first step output (the KV of a prompt
    arrived), a failure (``error``: the request is ended in the engine), or neither (a migrated stream
    decodes on)."""

    request_id: str
    first_step: Any = None
    error: str | None = None
    retryable: bool = True
    received: Any = None  # the receiver's ``ReceivedTransfer`` (bytes, transport, seconds) when the KV arrived


class KVSink:
    """The receiving half: ``expect``, ``progress``, ``expire``, ``tear_down`` / ``cancel``, ``abandon``
    (see the module docstring)."""

    def __init__(self, receiver, links: SourceLinks, engine: SinkEngine, worker_id: str, ttl_s: float) -> None:
        self.receiver = receiver  # kv_transfer.receiver.KVReceiver
        self.links = links
        self.engine = engine
        self.worker_id = worker_id
        self.ttl_s = ttl_s
        self.transfers: dict[str, SinkTransfer] = {}

    @property
    def endpoint(self) -> str:
        return self.receiver.endpoint

    @property
    def num_bad_frames(self) -> int:
        return self.links.num_bad_frames

    def stats(self):
        return self.receiver.stats()

    def sockets(self) -> list:
        return self.links.sockets()

    def get(self, request_id: str) -> SinkTransfer | None:
        return self.transfers.get(request_id)

    def owns(self, request_id: str) -> bool:
        """Whether ``request_id`` waits for its KV here (queued, requested or being torn down)."""
        transfer = self.transfers.get(request_id)
        return transfer is not None and transfer.status is not SinkStatus.ARRIVED

    # ------------------------------------------------------------ progress
    def expect(self, request: GenerateRequest) -> None:
        """The engine queued ``request`` for a reservation (``add_request(remote_prefill=True)``)."""
        self.transfers[request.request_id] = SinkTransfer(request)

    def progress(self, now: float | None = None) -> list[SinkEvent]:
        """Reserve and request what fits, read the sources' answers, take the receiver's verdicts."""
        now = time.monotonic() if now is None else now
        for reservation in self.engine.reserve_remote():
            self._request(self.transfers[reservation.request_id], reservation, now)
        for answer in self.links.receive():
            transfer = self.transfers.get(answer.request_id)
            if transfer is None or transfer.status not in IN_FLIGHT:
                continue
            if isinstance(answer, PrefillAccepted):
                self._answered(transfer, SinkStatus.QUEUED_AT_SOURCE, math.inf)
            elif isinstance(answer, PrefillStarted):
                self._answered(transfer, SinkStatus.TRANSFERRING, now + self.ttl_s)
            else:
                self.tear_down(answer.request_id, f"prefill rejected: {answer.error}", answer.retryable, notify=False)
        events = []
        for done in self.receiver.poll():
            event = self._on_done(done)
            if event is not None:
                events.append(event)
        return events

    def _request(self, transfer: SinkTransfer, reservation, now: float) -> None:
        request = transfer.request
        block_ids = self.engine.block_table(transfer.request_id)
        ask = PrefillRequest(
            request_id=transfer.request_id,
            # a live-migrated stream: its prompt and every token sent, whose KV the source holds
            prompt_token_ids=list(reservation.token_ids) if transfer.is_migration else request.prompt_token_ids,
            sampling_params=request.sampling_params,
            dst_block_ids=block_ids,
            num_cached_tokens=reservation.num_cached_tokens,
            transfer_endpoint=self.receiver.endpoint,
            decode_worker_id=self.worker_id,
            ttl_s=self.ttl_s,
            source_request_id=request.kv_source_request_id,
            priority=request.priority,
            trace_context=request.trace_context,
        )
        layout = self.receiver.layout
        if leaves_blocks_incomplete(layout, ask):  # a sliding layer's blocks before its window never come
            self.engine.withhold_from_prefix_cache(transfer.request_id)
        self.receiver.expect(transfer.request_id, block_ids, planned_bytes(layout, ask))
        self.links.send(request.prefill_endpoint, ask)
        transfer.status, transfer.ttl_deadline = SinkStatus.REQUESTED, now + self.ttl_s  # until the source answers

    @staticmethod
    def _answered(transfer: SinkTransfer, status: SinkStatus, ttl_deadline: float) -> None:
        if transfer.status is not SinkStatus.ABORTING:
            transfer.status, transfer.ttl_deadline = status, ttl_deadline

    def _on_done(self, done) -> SinkEvent | None:
        rid = done.request_id
        transfer = self.transfers.get(rid)
        if transfer is None or transfer.status not in IN_FLIGHT:
            return None
        del self.transfers[rid]
        if transfer.failure is None and done.ok:
            try:
                prefill = decode_prefill_done(done.payload)
            except msgspec.DecodeError as exc:
                transfer.failure = f"malformed PrefillDone payload: {exc}"
            else:
                event = self._activate(transfer, prefill, done.num_bytes)
                event.received = done
                return event
        self.engine.abort_request(rid)  # the receiver let go: the blocks are free to reuse
        if transfer.failure == "cancelled":
            return None
        return SinkEvent(rid, error=transfer.failure or f"KV transfer failed: {done.error}",
                         retryable=transfer.retryable)

    def _activate(self, transfer: SinkTransfer, prefill, num_bytes: int) -> SinkEvent:
        rid = transfer.request_id
        if transfer.is_migration:  # its last token was sent before the move: nothing is emitted again
            self.engine.activate_migrated(rid, prefill.num_draft_computed_tokens)
            transfer.status, transfer.num_migrated_bytes = SinkStatus.ARRIVED, num_bytes
            self.transfers[rid] = transfer
            return SinkEvent(rid)
        first_logprobs = None
        if prefill.first_logprobs is not None:  # sampled first, then top-N: a dict holds both
            first_logprobs = {lp.token_id: lp.logprob for lp in prefill.first_logprobs}
        return SinkEvent(rid, first_step=self.engine.activate_remote(rid, prefill.first_token_id, first_logprobs,
                                                                     prefill.prompt_logprobs,
                                                                     prefill.num_computed_tokens))

    def take_migrated_bytes(self, request_id: str) -> int:
        """An ARRIVED stream's KV bytes, once (for its first delta); the record goes with them."""
        transfer = self.transfers.get(request_id)
        if transfer is None or transfer.status is not SinkStatus.ARRIVED:
            return 0
        del self.transfers[request_id]
        return transfer.num_migrated_bytes

    # ------------------------------------------------------------ ends
    def expire(self, now: float | None = None) -> None:
        """Tear down every request whose source did not answer, or whose KV stopped coming, within the TTL: a
        transferring request's TTL runs from its last piece of KV landed (a long prompt is slow, not stuck)."""
        now = time.monotonic() if now is None else now
        for transfer in list(self.transfers.values()):
            if transfer.status in IN_FLIGHT and transfer.status is not SinkStatus.ABORTING \
                    and now > transfer.ttl_deadline:
                landed = self.receiver.last_landed(transfer.request_id) \
                    if transfer.status is SinkStatus.TRANSFERRING else None
                if landed is not None and now <= landed + self.ttl_s:
                    transfer.ttl_deadline = landed + self.ttl_s
                    continue
                logger.warning("request %s: no KV from the prefill worker within %.1fs", transfer.request_id,
                               self.ttl_s)
                self.tear_down(transfer.request_id, "prefill timed out", retryable=True, notify=True)

    def tear_down(self, request_id: str, reason: str, retryable: bool, notify: bool = True) -> bool:
        """End a request that waits for its KV: queued, at once (engine aborted); requested, the receiver stops
        expecting (and with ``notify`` the source is told), and the next ``progress`` reports it once the
        receiver lets go. False when the sink does not hold it (an ARRIVED record is dropped then)."""
        transfer = self.transfers.get(request_id)
        if transfer is None:
            return False
        if transfer.status is SinkStatus.ARRIVED:
            del self.transfers[request_id]
            return False
        if transfer.status is SinkStatus.ABORTING:
            return True
        transfer.failure, transfer.retryable = reason, retryable
        if transfer.status is SinkStatus.WAITING_FOR_BLOCKS:
            del self.transfers[request_id]
            self.engine.abort_request(request_id)
            return True
        transfer.status = SinkStatus.ABORTING
        self._stop(transfer, notify)
        return True

    def cancel(self, request_id: str) -> bool:
        """The router cancelled it: ``tear_down`` with nothing to report."""
        return self.tear_down(request_id, "cancelled", retryable=False, notify=True)

    def abandon(self, request_id: str) -> None:
        """The worker stops: forget ``request_id`` now (its source is told; the caller ends it in the engine)."""
        transfer = self.transfers.pop(request_id, None)
        if transfer is not None and transfer.status in IN_FLIGHT:
            self._stop(transfer, notify=True)

    def _stop(self, transfer: SinkTransfer, notify: bool) -> None:
        self.receiver.abort(transfer.request_id)
        if notify:
            self.links.send(transfer.request.prefill_endpoint, CancelPrefill(request_id=transfer.request_id))

    def close(self) -> None:
        self.receiver.close()
        self.links.close()
