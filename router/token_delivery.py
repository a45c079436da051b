"""Token delivery: a worker's token deltas on their way to each request's queue.

``TokenDelivery`` is a part of ``router.dispatcher.Dispatcher`` (a mixin, as ``router.migration`` is: it
uses the dispatcher's requests, registry, metrics and socket), kept apart because it is one concern:

* A decode (or colocated) worker's deltas go to their request's queue, with TTFT, inter-token gaps and
  the tokens a migration would resume after; a delta for a request it should not have gets a cancel.
* A retryable error before any token sends the request elsewhere (``router.migration``).
* Under P/D the prefill worker sends the first token beside the KV. It streams at once (only while the
  request may still migrate: a failed transfer then resumes after it), and the decode worker's copy of
  it is dropped from its first delta. A late one, or one for an attempt that moved on, is ignored.
"""

from __future__ import annotations

import time

from pipeline.protocol.cluster import CancelRequest, FinishCode, TokenBatch, TokenDelta
from router.request_handle import RequestHandle


class TokenDelivery:
    """The dispatcher's handling of ``TokenBatch`` messages (see the module docstring)."""

    def _on_token_batch(self, worker_id: str, batch: TokenBatch) -> None:
        """A worker's token deltas, each to its request (or a cancel back, for a request it no longer has)."""
        self.registry.touch(worker_id)
        now = time.monotonic()
        for delta in batch.outputs:
            handle = self._requests.get(delta.request_id)
            if handle is not None and worker_id == handle.prefill_worker_id != handle.decode_worker_id:
                self._on_prefill_first_token(handle, delta, now)
                continue
            if handle is None or handle.decode_worker_id != worker_id:
                if (info := self.registry.get(worker_id)) is not None and not info.can_decode:
                    continue  # a prefill worker's first token for an attempt that has moved on
                if delta.finish_reason is None and delta.request_id not in self._cancelled:
                    self._remember_cancel(delta.request_id)
                    self._send(worker_id, CancelRequest(request_id=delta.request_id))
                continue
            if delta.finish_reason == FinishCode.ERROR and delta.retryable and not delta.token_ids:
                if (handle.kv_source is not None and not delta.is_prefill_failure
                        and self._return_handoff(handle, worker_id, delta.error or "error")):
                    continue
                # Blame the prefill worker when the decode worker says its side failed: the retry may
                # go back to this decode worker (the only one, perhaps) with another prefill worker,
                # or prefill locally when none is left.
                culprit = handle.prefill_worker_id if delta.is_prefill_failure and handle.prefill_worker_id else worker_id
                self._retry_or_fail(handle, culprit, f"worker {worker_id}: {delta.error or 'error'}", 503,
                                    cause="worker_error")
                continue
            if handle.first_token_from_prefill and delta.token_ids:
                self._drop_streamed_first_token(handle, delta)
            if delta.token_ids:
                self._note_tokens(handle, delta, now)
            handle.queue.put_nowait(delta)
            if delta.finish_reason == FinishCode.ERROR:
                self._finish(handle)
            elif delta.finish_reason is not None:
                if self.warmups is not None:
                    self.warmups.after_turn(handle)
                self._choice_finished(handle, delta.index)

    def _note_tokens(self, handle: RequestHandle, delta: TokenDelta, now: float) -> None:
        """Bookkeeping of tokens on their way to the client: the tokens a migration resumes after, TTFT,
        inter-token gaps, the end of a migration's pause."""
        if handle.num_choices == 1:
            handle.output_token_ids.extend(delta.token_ids)
        if not handle.has_tokens:
            handle.has_tokens = True
            self._release_prefill(handle)
            self.metrics.queue_depth.dec()
            self.metrics.ttft_seconds.observe(now - handle.created_at)
        elif handle.paused_since is not None:  # the first tokens after a migration
            self.metrics.migration_pause_seconds.observe(now - handle.paused_since)
            handle.paused_since = None
            if handle.kv_source is not None:  # a handoff is complete: the draining worker has let it go
                self._handoff_done(handle, delta.num_migrated_kv_bytes)
        else:  # tokens that arrive together share the gap since the previous ones
            gap = (now - handle.last_token_at) / len(delta.token_ids)
            for _ in delta.token_ids:
                self.metrics.itl_seconds.observe(gap)
        handle.last_token_at = now

    def _on_prefill_first_token(self, handle: RequestHandle, delta: TokenDelta, now: float) -> None:
        """A prefill worker's first token, sent beside the KV: streamed at once, unless the decode worker's
        copy came first (the KV arrived and was verified before this message). Only while the request may
        still migrate: should the transfer then fail, its retry resumes after this token (by replay)."""
        if (handle.has_tokens or not self._can_migrate(handle) or len(delta.token_ids) != 1
                or delta.finish_reason is not None):
            return
        handle.first_token_from_prefill = True
        self.metrics.prefill_first_tokens_total.inc()
        self._note_tokens(handle, delta, now)
        handle.queue.put_nowait(delta)

    @staticmethod
    def _drop_streamed_first_token(handle: RequestHandle, delta: TokenDelta) -> None:
        """The decode worker's first delta repeats the first token its prefill worker streamed (it emits the
        one ``PrefillDone`` brought): strip it, its logprobs and the prompt's."""
        handle.first_token_from_prefill = False
        delta.token_ids = delta.token_ids[1:]
        if delta.logprobs is not None:
            delta.logprobs = delta.logprobs[1:]
        delta.prompt_logprobs = None
