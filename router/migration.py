"""Retries and migration: where a request goes when its worker dies, fails it, or drains.

``Migration`` is the dispatcher's collaborator for this one concern:

* **Retry** (no token yet): the request goes to another route under a fresh wire id, while attempts
  remain (``max_attempts``). It stays ROUTED.
* **Migration by replay** (tokens sent; a single choice; at most ``max_migrations`` times): the request
  is MIGRATING until the new worker's first tokens. That worker gets the prompt plus every token the
  client already has (``resume_token_ids``), recomputes their KV and goes on from the next position.
* **Live migration** (a draining DecodeOnly worker's ``HandoffOffer``): another DecodeOnly worker gets
  the stream with ``kv_source_request_id`` and fetches its KV from the draining one, so nothing is
  recomputed; the request is HANDING_OFF meanwhile. No target: ``HandoffDeclined``, and the stream
  decodes on where it is. A handoff that fails before the new worker's first tokens falls back to replay.

A retry or migration that finds every worker saturated waits at the front of the admission queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import msgspec

from pipeline.protocol.cluster import CancelRequest, GenerateRequest, HandoffDeclined, HandoffOffer
from router.in_flight import InFlightRequests
from router.kv_index import PromptHashes
from router.metrics import RouterMetrics
from router.policy import NoRoute, Route, WorkerView, choose_handoff_target
from router.registry import WorkerInfo, WorkerRegistry
from router.request_handle import RequestHandle, RequestStatus

logger = logging.getLogger(__name__)


class Migration:
    """Moves requests off workers that die, fail them, or drain (see the module docstring).

    What it needs from the dispatcher comes in explicitly: ``send`` (a message to a worker; False when it
    cannot go out), ``views`` (the live workers as routing sees them), ``requeue`` (a request admitted once
    goes back to the front of the admission queue: its admission future; raises ``NoRoute`` when nobody
    can serve it) and ``fail`` (end a request with an error).
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        in_flight: InFlightRequests,
        metrics: RouterMetrics,
        *,
        send: Callable[[str, msgspec.Struct], bool],
        views: Callable[[PromptHashes | None], list[WorkerView]],
        requeue: Callable[[RequestHandle], asyncio.Future],
        fail: Callable[[RequestHandle, str, int], None],
        max_attempts: int,
        max_migrations: int,
        kv_overlap_weight: float | None,
    ) -> None:
        self.registry = registry
        self.in_flight = in_flight
        self.metrics = metrics
        self.send = send
        self.views = views
        self.requeue = requeue
        self.fail = fail
        self.max_attempts = max_attempts
        self.max_migrations = max_migrations
        self.kv_overlap_weight = kv_overlap_weight

    def can_migrate(self, handle: RequestHandle) -> bool:
        """A stream with tokens moves on (the new worker recomputes them) when it is one choice and migrations remain."""
        return handle.num_choices == 1 and handle.num_migrations < self.max_migrations

    def retry_or_fail(self, handle: RequestHandle, failed_worker: str, message: str, status_code: int = 503,
                      cause: str = "worker_died", is_planned: bool | None = None) -> None:
        """Send the request elsewhere: before its first token while attempts remain, after it as a migration
        (the client's stream goes on where it stopped); else fail it. An attempt that failed because its
        worker was stopping on purpose (``is_planned``; None: the worker's last report says whether it
        drains) is not counted against ``max_attempts``."""
        if handle.is_done:
            return
        is_migration = handle.has_tokens
        if is_planned is None:
            is_planned = self._is_draining(failed_worker)
        if not is_migration and is_planned:
            handle.num_excused_attempts += 1  # a planned stop (drain, rolling restart) is not the request's fault
        if time.monotonic() >= handle.deadline or (
                not self.can_migrate(handle) if is_migration
                else handle.num_attempts - handle.num_excused_attempts >= self.max_attempts):
            self.fail(handle, message, status_code)
            return
        if is_migration:
            handle.num_migrations += 1
            if handle.status not in (RequestStatus.MIGRATING, RequestStatus.HANDING_OFF):  # else paused already
                handle.paused_since = handle.last_token_at
            handle.trace.migrating(cause, failed_worker, len(handle.output_token_ids))
            logger.warning("request %s migrates off %s after %d tokens (%s)", handle.request_id, failed_worker,
                           len(handle.output_token_ids), message)
        self.abandon_handoff(handle)
        if is_migration:
            handle.set_status(RequestStatus.MIGRATING)
        old_decode = handle.decode_worker_id
        if old_decode and old_decode != failed_worker and self.registry.is_alive(old_decode):
            self.send(old_decode, CancelRequest(request_id=handle.wire_id))
        self.in_flight.remember_cancel(handle.wire_id)
        self.in_flight.unassign(handle)
        self.in_flight.exclude(handle, failed_worker)
        try:  # it was admitted once: it goes ahead of everyone who waits, and waits if all are saturated
            admission = self.requeue(handle)
        except NoRoute as exc:
            self.fail(handle, f"{message}; no other worker to retry on ({exc})", status_code)
            return
        if not is_migration:  # a move after tokens is a migration, counted once it went on (_note_sent)
            self.metrics.retries_total.inc()
        if admission.done():
            self._note_sent(handle, is_migration, cause)
            logger.info("request %s retried as %s after: %s", handle.request_id, handle.wire_id, message)
            return
        logger.info("request %s waits for a worker to retry on after: %s", handle.request_id, message)
        admission.add_done_callback(
            lambda admission: self._on_retry_admission(handle, admission, message, status_code, is_migration, cause))

    def _note_sent(self, handle: RequestHandle, is_migration: bool, cause: str) -> None:
        """A stream went on on another worker: counted as a migration only now, once it did."""
        if is_migration:
            self.metrics.migrations_total.labels(cause).inc()
            self.metrics.migration_recomputed_tokens.inc(len(handle.prompt_token_ids) + len(handle.output_token_ids))

    def _on_retry_admission(self, handle: RequestHandle, admission: asyncio.Future, message: str,
                            status_code: int, is_migration: bool, cause: str) -> None:
        if admission.cancelled():  # the request was cancelled while it waited
            return
        error = admission.exception()
        if isinstance(error, NoRoute):  # it waited for a worker to come back, and none did
            self.fail(handle, f"{message}; no worker that can serve it came back in time ({error})", status_code)
        elif error is not None:
            self.fail(handle, f"{message}; no worker free to retry on ({error})", status_code)
        else:
            self._note_sent(handle, is_migration, cause)

    def _is_draining(self, worker_id: str) -> bool:
        """Whether ``worker_id`` (its last known incarnation) said it is shutting down on purpose."""
        info = self.registry.get(worker_id)
        return info is not None and info.load.is_draining

    def on_worker_dead(self, worker: WorkerInfo) -> None:
        """Every request on ``worker`` (decoding there, prefilling there before its first token, or handing
        off from there) moves on or fails."""
        is_planned = worker.load.is_draining  # this incarnation was stopping on purpose (its last report)
        for handle in self.in_flight.handles():
            if handle.decode_worker_id == worker.worker_id:
                self.retry_or_fail(handle, worker.worker_id, f"worker {worker.worker_id}, decoding it, was lost "
                                   "(it exited or stopped answering)", is_planned=is_planned)
            elif handle.prefill_worker_id == worker.worker_id and not handle.has_tokens:
                self.retry_or_fail(handle, worker.worker_id, f"worker {worker.worker_id}, prefilling it, was lost "
                                   "(it exited or stopped answering)", is_planned=is_planned)
            elif (handle.status is RequestStatus.HANDING_OFF and handle.kv_source is not None
                  and handle.kv_source[0] == worker.worker_id):
                handle.kv_source = None  # nobody to tell: its KV is gone, the new worker recomputes it
                handle.set_status(RequestStatus.MIGRATING)
                self.retry_or_fail(handle, worker.worker_id, f"worker {worker.worker_id} was lost while handing it "
                                   "off (it exited or stopped answering)")

    # ------------------------------------------------------------------ live migration (drain)

    def on_handoff_offer(self, worker_id: str, offer: HandoffOffer) -> None:
        """A draining worker paused a stream: move it, with its KV, to another DecodeOnly worker, or decline."""
        handle = self.in_flight.get(offer.request_id)
        if handle is None or handle.is_done or handle.decode_worker_id != worker_id:
            self._decline(worker_id, offer.request_id, "unknown stream")
            return
        resume = handle.output_token_ids
        num_tokens = len(handle.prompt_token_ids) + len(resume)
        prompt = PromptHashes(handle.prompt_token_ids + resume) if self.kv_overlap_weight is not None else None
        try:
            if not self.can_migrate(handle) or not resume:
                raise NoRoute("no migrations left")
            target = choose_handoff_target(
                self.views(prompt), len(handle.prompt_token_ids) + (handle.sampling_params.max_tokens or 0),
                self.in_flight.excluded(handle) | {worker_id}, num_cached_tokens=num_tokens,
                kv_overlap_weight=self.kv_overlap_weight)
        except NoRoute as exc:
            self._decline(worker_id, offer.request_id, str(exc))
            return
        wire_id = handle.new_attempt()
        params = handle.sampling_params
        if params.prompt_logprobs is not None:  # the client has them already
            params = msgspec.structs.replace(params, prompt_logprobs=None)
        handle.trace.migrating("drain", worker_id, len(resume))
        if not self.send(target.worker_id, GenerateRequest(
                request_id=wire_id, prompt_token_ids=handle.prompt_token_ids, sampling_params=params,
                prefill_worker_id=worker_id, prefill_endpoint=offer.endpoint,
                deadline_s=max(0.001, handle.deadline - time.monotonic()), resume_token_ids=resume,
                kv_source_request_id=offer.request_id, priority=handle.priority,
                trace_context=handle.trace.context)):
            handle.trace.migrated()
            self._decline(worker_id, offer.request_id, "the target is unreachable")
            return
        self.in_flight.unassign(handle)
        self.in_flight.assign(handle, Route(decode=target, prefill=None), wire_id)
        handle.num_migrations += 1
        handle.paused_since = handle.last_token_at
        handle.kv_source = (worker_id, offer.request_id)
        handle.set_status(RequestStatus.HANDING_OFF)
        handle.trace.handed_off(target.worker_id)
        logger.info("request %s hands off from draining %s to %s after %d tokens", handle.request_id, worker_id,
                    target.worker_id, len(resume))

    def _decline(self, worker_id: str, stream_id: str, reason: str) -> None:
        self.metrics.handoffs_declined_total.inc()
        self.send(worker_id, HandoffDeclined(request_id=stream_id, reason=reason))

    def handoff_done(self, handle: RequestHandle, num_kv_bytes: int) -> None:
        """The new worker's first tokens after a handoff: the stream moved with its KV (the draining worker
        has let it go). The caller, who delivers those tokens, moves the request back to STREAMING."""
        handle.kv_source = None
        self.metrics.migrations_total.labels("drain").inc()
        self.metrics.migration_kv_bytes.inc(num_kv_bytes)

    def return_handoff(self, handle: RequestHandle, target_id: str, reason: str) -> bool:
        """The target refused the HANDING_OFF stream before asking for its KV (it drains too, or its queue is
        full): the stream goes back to the draining worker, which still holds it paused, and decodes on
        there. False when that worker is gone (then the stream is replayed)."""
        source, stream_id = handle.kv_source
        view = next((v for v in self.views(None) if v.worker_id == source), None)
        if view is None:
            return False
        self.in_flight.remember_cancel(handle.wire_id)
        self.in_flight.unassign(handle)
        self.in_flight.exclude(handle, target_id)
        handle.kv_source = None
        handle.trace.migrated()
        handle.num_migrations -= 1
        handle.set_status(RequestStatus.STREAMING)
        self.in_flight.assign(handle, Route(decode=view, prefill=None), stream_id)
        logger.info("request %s stays on %s: %s refused it (%s)", handle.request_id, source, target_id, reason)
        self._decline(source, stream_id, f"{target_id} refused it: {reason}")
        return True

    def abandon_handoff(self, handle: RequestHandle) -> None:
        """The request ends or moves on before its handoff completed: the draining worker frees the stream.
        The caller moves it on (MIGRATING or FINISHED)."""
        if handle.status is RequestStatus.HANDING_OFF and handle.kv_source is not None:
            source, stream_id = handle.kv_source
            handle.kv_source = None
            self.send(source, CancelRequest(request_id=stream_id))
