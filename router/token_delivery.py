"""Token delivery: a worker's token deltas on their way to each request's queue.

``TokenDelivery`` is the dispatcher's collaborator for ``TokenBatch`` messages:

* A decode (or colocated) worker's deltas go to their request's queue, with TTFT, inter-token gaps and
  the tokens a migration would resume after; a delta for a request it should not have gets a cancel.
  The first tokens move the request to STREAMING (from ROUTED, or back from MIGRATING / HANDING_OFF).
* A retryable error before any token of an attempt sends the request elsewhere (``router.migration``).
* Under P/D the prefill worker sends the first token beside the KV. It streams at once (only while the
  request may still migrate: a failed transfer then resumes after it; FIRST_TOKEN_FROM_PREFILL), and the
  decode worker's copy of it is dropped from its first delta. A late one, or one for an attempt that
  moved on, is ignored.
"""

from __future__ import annotations

import time
from typing import Callable

import msgspec

from pipeline.protocol.cluster import CancelRequest, FinishCode, TokenBatch, TokenDelta
from router.in_flight import InFlightRequests
from router.metrics import RouterMetrics
from router.migration import Migration
from router.registry import WorkerRegistry
from router.request_handle import RequestHandle, RequestStatus


class TokenDelivery:
    """Delivers ``TokenBatch`` messages (see the module docstring).

    Explicit dependencies: ``send`` (a message to a worker), ``migration`` (retries, handoffs), and the
    dispatcher's ``finish`` (the request ends: off its workers, out of the gauges) and ``finish_choice``
    (one choice ended; the request ends with its last). ``after_turn``, when given, hears of each request
    that ended well (``PrefillWarmups.after_turn``).
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        in_flight: InFlightRequests,
        metrics: RouterMetrics,
        migration: Migration,
        *,
        send: Callable[[str, msgspec.Struct], bool],
        finish: Callable[[RequestHandle], None],
        finish_choice: Callable[[RequestHandle, int], None],
        after_turn: Callable[[RequestHandle], None] | None = None,
    ) -> None:
        self.registry = registry
        self.in_flight = in_flight
        self.metrics = metrics
        self.migration = migration
        self.send = send
        self.finish = finish
        self.finish_choice = finish_choice
        self.after_turn = after_turn

    def on_token_batch(self, worker_id: str, batch: TokenBatch) -> None:
        """A worker's token deltas, each to its request (or a cancel back, for a request it no longer has)."""
        self.registry.touch(worker_id)
        now = time.monotonic()
        for delta in batch.outputs:
            handle = self.in_flight.get(delta.request_id)
            if handle is not None and worker_id == handle.kv_source_worker_id != handle.decode_worker_id:
                self._on_prefill_first_token(handle, delta, now)  # ignored unless it is the first token
                continue
            if handle is None or handle.decode_worker_id != worker_id:
                if (info := self.registry.get(worker_id)) is not None and not info.can_decode:
                    continue  # a prefill worker's first token for an attempt that has moved on
                if delta.finish_reason is None and not self.in_flight.was_cancelled(delta.request_id):
                    self.in_flight.remember_cancel(delta.request_id)
                    self.send(worker_id, CancelRequest(request_id=delta.request_id))
                continue
            if delta.finish_reason == FinishCode.ERROR and delta.retryable and not delta.token_ids:
                self._on_retryable_error(handle, worker_id, delta)
                continue
            if handle.status is RequestStatus.FIRST_TOKEN_FROM_PREFILL and delta.token_ids:
                self._drop_streamed_first_token(handle, delta)
            if delta.token_ids:
                self._note_tokens(handle, delta, now)
            handle.queue.put_nowait(delta)
            if delta.finish_reason == FinishCode.ERROR:
                self.finish(handle)
            elif delta.finish_reason is not None:
                if handle.num_choices == 1:
                    self.metrics.per_worker.note_finished(worker_id, handle.first_token_at, handle.last_token_at,
                                                          len(handle.output_token_ids))
                if self.after_turn is not None:
                    self.after_turn(handle)
                self.finish_choice(handle, delta.index)

    def _on_retryable_error(self, handle: RequestHandle, worker_id: str, delta: TokenDelta) -> None:
        """The worker failed this attempt before a token: back to the draining worker of a refused handoff,
        else a retry (or migration) elsewhere."""
        reason = delta.error or "error"
        if (handle.status is RequestStatus.HANDING_OFF and not delta.is_prefill_failure
                and self.migration.return_handoff(handle, worker_id, reason)):
            return
        # Blame where the KV came from when the decode worker says that side failed: the retry may go back
        # to this decode worker (the only one, perhaps) with another prefill worker, or prefill locally when
        # none is left.
        kv_source = handle.kv_source_worker_id
        culprit = kv_source if delta.is_prefill_failure and kv_source else worker_id
        self.migration.retry_or_fail(handle, culprit, f"worker {worker_id}: {reason}", 503, cause="worker_error")

    def _note_tokens(self, handle: RequestHandle, delta: TokenDelta, now: float, *,
                     is_from_prefill: bool = False) -> None:
        """Bookkeeping of tokens on their way to the client: the tokens a migration resumes after, TTFT,
        inter-token gaps, the end of a migration's pause."""
        if handle.num_choices == 1:
            handle.output_token_ids.extend(delta.token_ids)
        handle.num_output_tokens += len(delta.token_ids)
        if handle.status is RequestStatus.ROUTED:  # its first token
            handle.set_status(RequestStatus.FIRST_TOKEN_FROM_PREFILL if is_from_prefill else RequestStatus.STREAMING)
            self.in_flight.release_prefill(handle)
            self.metrics.queue_depth.dec()
            self.metrics.ttft_seconds.observe(now - handle.created_at)
            self.metrics.per_priority.note_first_token(handle.priority, now - handle.created_at)
            self.metrics.per_worker.note_first_token((handle.decode_worker_id, handle.prefill_worker_id),
                                                     now - handle.created_at)
            handle.first_token_at = now
        elif handle.status in (RequestStatus.MIGRATING, RequestStatus.HANDING_OFF):  # the first tokens after a move
            self.metrics.migration_pause_seconds.observe(now - handle.paused_since)
            handle.trace.migrated()  # the pause is over
            if handle.status is RequestStatus.HANDING_OFF:
                self.migration.handoff_done(handle, delta.num_migrated_kv_bytes)
            handle.set_status(RequestStatus.STREAMING)
        else:  # tokens that arrive together share the gap since the previous ones
            gap = (now - handle.last_token_at) / len(delta.token_ids)
            for _ in delta.token_ids:
                self.metrics.itl_seconds.observe(gap)
        handle.last_token_at = now

    def _on_prefill_first_token(self, handle: RequestHandle, delta: TokenDelta, now: float) -> None:
        """A prefill worker's first token, sent beside the KV: streamed at once, unless the decode worker's
        copy came first (the KV arrived and was verified before this message). Only while the request may
        still migrate: should the transfer then fail, its retry resumes after this token (by replay)."""
        if (handle.has_tokens or not self.migration.can_migrate(handle) or len(delta.token_ids) != 1
                or delta.finish_reason is not None):
            return
        self.metrics.prefill_first_tokens_total.inc()
        self._note_tokens(handle, delta, now, is_from_prefill=True)
        handle.queue.put_nowait(delta)

    @staticmethod
    def _drop_streamed_first_token(handle: RequestHandle, delta: TokenDelta) -> None:
        """The decode worker's first delta repeats the first token its prefill worker streamed (it emits the
        one ``PrefillDone`` brought): strip it, its logprobs and the prompt's."""
        handle.set_status(RequestStatus.STREAMING)
        delta.token_ids = delta.token_ids[1:]
        if delta.logprobs is not None:
            delta.logprobs = delta.logprobs[1:]
        delta.prompt_logprobs = None
