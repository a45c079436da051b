"""Requests in flight between the HTTP layer and the workers: admission, routing, cancels, worker messages.

Worker messages arrive through ``WorkerSocket`` (registration, heartbeats, token batches) and requests
and cancels leave through it. Everything runs on the HTTP server's event loop, so no locks.

Each request has a ``RequestHandle`` (its ``RequestStatus`` and an asyncio queue that receives its
``TokenDelta``s, or one ``RequestFailed`` when the request cannot finish). The dispatcher owns three
collaborators and hands each what it needs explicitly: ``InFlightRequests`` (which request each wire id
names and the load it puts on its workers), ``Migration`` (retries and moves when a worker dies, fails a
request or drains: ``router/migration.py``) and ``TokenDelivery`` (token batches to each request's queue:
``router/token_delivery.py``). Every attempt has a fresh wire id, so late messages of an old one cannot
mix in. A heartbeat that claims another worker's id counts as a bad frame.

Admission: a request goes to a worker only while one has a free slot in its batch (router-side
in-flight count < the ``max_batch_size`` it registered with). When none has, ``submit`` queues it in
the ``AdmissionQueue`` (by priority, then first in first out; bounded, timed) and the HTTP layer awaits
``wait_admitted`` before it starts a response, so an overload is a 429 at once, never a stream that
dies later. A retry that finds every worker saturated waits at the front of that queue. Slots free
when a request finishes, fails or is cancelled, and a worker may appear, die, come back or report
load: each of those wakes the queue.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping

import msgspec

from pipeline.endpoints import router_endpoint
from pipeline.protocol.cluster import (
    CancelRequest,
    GenerateRequest,
    HandoffOffer,
    Heartbeat,
    KVEvents,
    RegisterAck,
    RegisterWorker,
    StartPrefill,
    TokenBatch,
    WorkerToRouter,
)
from pipeline.protocol.requests import SamplingParams
from router.admission import AdmissionQueue, Displaced, MeanSlotHold, Overloaded
from router.kv_index import PromptHashes
from router.metrics import RouterMetrics
from router.in_flight import InFlightRequests
from router.migration import Migration
from router.policy import NoRoute, PromptTooLong, Saturated, WorkerView, choose_route
from router.prefill_warmups import PrefillWarmups
from router.registry import WorkerInfo, WorkerRegistry, registration_refusal
from router.request_handle import RequestFailed, RequestHandle, RequestStatus
from router.request_trace import request_trace
from router.token_delivery import TokenDelivery
from router.worker_socket import WorkerSocket

logger = logging.getLogger(__name__)



class Dispatcher:
    """The HTTP layer's side: ``submit``, ``wait_admitted``, ``cancel``, ``cancel_choice``, ``retry_after_s``,
    and ``start`` / ``stop`` around the app's life (see the module docstring)."""

    def __init__(
        self,
        zmq_endpoint_base: str,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        model_name: str,
        max_attempts: int = 2,
        *,
        max_queued_requests: int = 256,
        queue_timeout_s: float = 60.0,
        max_local_prefill_length: int = 0,
        prefill_spill_tokens: int | None = None,
        kv_overlap_weight: float | None = None,
        max_migrations: int = 3,
        warm_prefill_cache: bool = False,
        early_prefill: bool = False,
        wait_for_worker_s: float = 0.0,
    ) -> None:
        """``kv_overlap_weight``: route by where the prompt's KV lives (``router.policy``); None: by load alone.
        ``max_migrations``: how often a stream whose worker died (or drained) moves to another worker.
        ``warm_prefill_cache``: prefill workers are asked to warm their prefix caches (``router.prefill_warmups``).
        ``early_prefill``: a disaggregated request's prefill worker gets the prompt (``StartPrefill``) as its
        decode worker gets the request, and starts before the decode worker has reserved blocks and asked.
        ``prefill_spill_tokens``: a prompt goes to its DecodeOnly worker instead of a prefill queue that much
        longer than the decode worker's own (``router.policy``); None: never.
        ``wait_for_worker_s``: a retry or migration that no live worker can serve waits this long for one to
        register (a restart) instead of failing at once."""
        self.socket = WorkerSocket(router_endpoint(zmq_endpoint_base), self._on_message, metrics.bad_frames_total.inc)
        self.registry = registry
        self.metrics = metrics
        self.model_name = model_name
        self.max_local_prefill_length = max_local_prefill_length
        self.prefill_spill_tokens = prefill_spill_tokens
        self.kv_overlap_weight = kv_overlap_weight
        self.warmups = PrefillWarmups(registry, metrics, self._send) if warm_prefill_cache else None
        self.early_prefill = early_prefill
        self.wait_for_worker_s = wait_for_worker_s
        self.admission: AdmissionQueue[RequestHandle] = AdmissionQueue(
            self._try_dispatch, max_queued_requests, queue_timeout_s, may_wait_for_a_route=self._worker_may_return)
        metrics.admission_queue_depth.set_function(lambda: len(self.admission))
        metrics.per_priority.bind_queue_depth(self.admission.depth_by_priority)
        self.in_flight = InFlightRequests(registry, on_slot_freed=self.admission.wake)
        self.migration = Migration(
            registry, self.in_flight, metrics, send=self._send, views=self._views, requeue=self._requeue,
            fail=self._fail, max_attempts=max_attempts, max_migrations=max_migrations,
            kv_overlap_weight=kv_overlap_weight)
        self.delivery = TokenDelivery(
            registry, self.in_flight, metrics, self.migration, send=self._send, finish=self._finish,
            finish_choice=self._choice_finished,
            after_turn=self.warmups.after_turn if self.warmups is not None else None)
        self._slot_hold = MeanSlotHold()  # feeds the Retry-After estimate
        self._housekeeping: asyncio.Task | None = None
        registry.on_worker_dead = self._on_worker_dead

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.socket.start()
        self._housekeeping = asyncio.get_running_loop().create_task(self._housekeeping_loop())

    async def stop(self) -> None:
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            await asyncio.gather(self._housekeeping, return_exceptions=True)
            self._housekeeping = None
        self.fail_everything("the router is shutting down")
        await self.socket.stop()

    def fail_everything(self, reason: str) -> None:
        """End every request waiting or in flight with a 503 (a stream: an error event), ``reason`` its message."""
        self.admission.close(NoRoute(reason))
        for handle in self.in_flight.handles():
            self._fail(handle, reason, 503)

    @property
    def num_bad_frames(self) -> int:
        return self.socket.num_bad_frames

    # ------------------------------------------------------------------ requests

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, timeout_s: float,
               priority: int = 0, trace_parent: Mapping[str, str] | None = None,
               counted: bool = True) -> RequestHandle:
        """Send a request to a worker now, or queue it while every worker is saturated.

        Raises at once, before anything was sent: ``Overloaded`` when it would have to wait and the
        admission queue is full of requests as good or better (429), ``NoRoute`` when no worker can serve
        it at all (503). A queued request is sent once a slot frees: await ``wait_admitted(handle)`` before
        reading from it. ``priority`` (lower first) orders the queue and goes to the workers.
        ``trace_parent``: the client's W3C trace context (its HTTP headers), which the request's trace continues.
        ``counted``: False for an HTTP request's further prompts (the queue's bound counts requests).
        """
        handle = RequestHandle(request_id, prompt_token_ids, params, deadline=time.monotonic() + timeout_s,
                               priority=priority)
        handle.trace = request_trace(request_id, len(prompt_token_ids), params.max_tokens, priority, trace_parent)
        enqueue = functools.partial(self.admission.enqueue, handle, priority=priority, counted=counted)
        try:
            try:  # the only decode worker drains or was restarted: it waits for it, as a retry would, not a 503
                handle.admission = enqueue(timeout_s=timeout_s, waits_for_a_route=self._worker_may_return(None))
            except NoRoute:  # as this router (restarted) has its workers register again, it waits those seconds
                registration_due_s = self.registry.registration_due_s() if self.wait_for_worker_s > 0 else 0.0
                if registration_due_s <= 0:
                    raise
                handle.admission = enqueue(timeout_s=min(timeout_s, registration_due_s), waits_for_a_route=True)
        except Overloaded as exc:
            exc.retry_after_s = self.retry_after_s()
            self._finish(handle, "failed (429)", str(exc))
            raise
        except NoRoute as exc:
            self._finish(handle, "failed (503)", str(exc))
            raise
        return handle

    def _worker_may_return(self, error: Exception | None) -> bool:
        """Whether a request nobody can serve now (``error``: why) waits for a decode-capable worker on its way
        back (``registry.expects_a_decode_worker_back``): not one too long for any worker, which no restart changes."""
        return (self.wait_for_worker_s > 0 and not isinstance(error, PromptTooLong)
                and self.registry.expects_a_decode_worker_back(self.model_name, self.wait_for_worker_s))

    async def wait_admitted(self, handle: RequestHandle) -> None:
        """Wait until ``handle`` was sent to a worker (returns at once if it was).

        Raises ``Overloaded`` when it waited past ``queue_timeout_s`` (or its own deadline) or a request of
        better priority took its place in a full queue (``Displaced``), and ``NoRoute`` when the workers
        that could serve it went away meanwhile. Cancelling the caller
        (the client left) takes the request out of the queue, or cancels it if it was just sent.
        """
        try:
            await handle.admission
        except Overloaded as exc:
            if isinstance(exc, Displaced):
                self.metrics.per_priority.note_displaced(handle.priority)
            exc.retry_after_s = self.retry_after_s()
            raise
        except asyncio.CancelledError:
            if handle.admission.done() and not handle.admission.cancelled():
                handle.admission.exception()  # it failed as the client left: mark it seen (no asyncio warning)
            self.cancel(handle)
            raise

    def cancel(self, handle: RequestHandle, outcome: str = "cancelled", error: str | None = None) -> None:
        """The client is gone or a stop string matched (or the router gave up on it: ``outcome`` and ``error``
        say why, for its trace): stop the worker (or leave the queue), forget it."""
        if handle.is_done:
            return
        if handle.decode_worker_id is not None:
            self._send(handle.decode_worker_id, CancelRequest(request_id=handle.wire_id))
        if handle.wire_id:
            self.in_flight.remember_cancel(handle.wire_id)
        self._finish(handle, outcome, error)

    def cancel_choice(self, handle: RequestHandle, index: int) -> None:
        """Stop one choice of an n > 1 request (a stop string matched); the request ends with its last choice."""
        if handle.is_done:
            return
        if handle.num_choices == 1:
            self.cancel(handle)
            return
        if handle.decode_worker_id is not None:
            self._send(handle.decode_worker_id, CancelRequest(request_id=handle.wire_id, index=index))
        self._choice_finished(handle, index)

    def _choice_finished(self, handle: RequestHandle, index: int) -> None:
        handle.finished_choices.add(index)
        if len(handle.finished_choices) >= handle.num_choices:
            self._finish(handle)

    def retry_after_s(self) -> int:
        """Whole seconds after which a request turned away now would likely find a free slot."""
        num_slots = sum(w.max_batch_size for w in self.registry.live_workers()
                        if w.can_decode and w.model_name == self.model_name and not w.load.is_draining)
        return self._slot_hold.retry_after_s(len(self.admission), num_slots)

    def _try_dispatch(self, handle: RequestHandle) -> bool:
        """The admission queue's ``try_admit``: send now; False while every worker is saturated."""
        if handle.is_done:  # cancelled while it waited: nothing to send
            return True
        try:
            self._dispatch(handle)
        except Saturated:
            return False
        if handle.status is RequestStatus.QUEUED:
            handle.trace.admitted()
            handle.set_status(RequestStatus.ROUTED)
            self.metrics.queue_depth.inc()
            self.metrics.requests_in_flight.inc()
            self.metrics.admission_wait_seconds.observe(time.monotonic() - handle.created_at)
            self.metrics.per_priority.note_admitted(handle.priority, time.monotonic() - handle.created_at)
        return True

    def _dispatch(self, handle: RequestHandle) -> None:
        """Route and send one attempt; raises ``NoRoute`` (``Saturated``: every worker's batch is full)."""
        num_prompt_tokens = len(handle.prompt_token_ids)
        needed = num_prompt_tokens + (handle.sampling_params.max_tokens or 0)
        resume = handle.output_token_ids if handle.has_tokens else []
        prompt = PromptHashes(handle.prompt_token_ids + resume) if self.kv_overlap_weight is not None else None
        params = handle.sampling_params
        if resume and params.prompt_logprobs is not None:  # the client has them already
            params = msgspec.structs.replace(params, prompt_logprobs=None)
        while True:
            # a migrated stream is recomputed where it will be decoded (its prompt + the tokens sent so far)
            views = self._views(prompt)
            route = choose_route(views, needed, self.in_flight.excluded(handle), num_prompt_tokens=num_prompt_tokens,
                                 max_local_prefill_length=(needed if resume else self.max_local_prefill_length),
                                 kv_overlap_weight=self.kv_overlap_weight,
                                 prefill_spill_tokens=self.prefill_spill_tokens)
            wire_id = handle.new_attempt()
            msg = GenerateRequest(
                request_id=wire_id,
                prompt_token_ids=handle.prompt_token_ids,
                sampling_params=params,
                prefill_worker_id=route.prefill.worker_id if route.prefill else None,
                prefill_endpoint=route.prefill.prefill_endpoint if route.prefill else None,
                deadline_s=max(0.001, handle.deadline - time.monotonic()),
                resume_token_ids=resume,
                priority=handle.priority,
                trace_context=handle.trace.context,
            )
            if self._send(route.decode.worker_id, msg):
                if route.prefill is not None and self.early_prefill:
                    self._send(route.prefill.worker_id, StartPrefill(request_id=wire_id, sampling_params=params,
                                                                     prompt_token_ids=handle.prompt_token_ids,
                                                                     priority=handle.priority,
                                                                     trace_context=handle.trace.context))
                self.in_flight.assign(handle, route, wire_id)
                handle.trace.routed(route, wire_id, handle.num_attempts, num_prompt_tokens, self.kv_overlap_weight)
                self.metrics.note_route(route, num_prompt_tokens)
                if self.warmups is not None and prompt is not None:
                    self.warmups.after_route(views, route, handle.prompt_token_ids)
                return
            self.in_flight.exclude(handle, route.decode.worker_id)

    def _requeue(self, handle: RequestHandle) -> asyncio.Future:
        """A request admitted once (a retry, a migration) goes ahead of everyone who waits, and waits if
        every worker is saturated, or, for ``wait_for_worker_s``, if no live worker can serve it (a restart may
        come); raises ``NoRoute`` at once when none can and that wait is 0."""
        timeout_s = max(0.001, handle.deadline - time.monotonic())
        if self.wait_for_worker_s > 0:
            timeout_s = min(timeout_s, self.wait_for_worker_s)
        handle.admission = self.admission.enqueue(handle, at_front=True, timeout_s=timeout_s, priority=handle.priority,
                                                  waits_for_a_route=self.wait_for_worker_s > 0)
        return handle.admission

    def _finish(self, handle: RequestHandle, outcome: str = "finished", error: str | None = None) -> None:
        """The request is over (``error``: what failed it, logged, a 429 only at INFO: overload is load)."""
        if handle.is_done:
            return
        if error is not None:
            level = logging.INFO if outcome == "failed (429)" else logging.WARNING
            logger.log(level, "request %s %s after %d tokens: %s", handle.request_id, outcome,
                       handle.num_output_tokens, error)
        handle.trace.finished(outcome, handle.num_output_tokens, error)
        self.migration.abandon_handoff(handle)
        self.admission.discard(handle)  # it may be waiting (new, or a retry) rather than on a worker
        slot_held_s = self.in_flight.unassign(handle)
        if slot_held_s is not None:
            self._slot_hold.note(slot_held_s)
        status = handle.status
        handle.set_status(RequestStatus.FINISHED)
        if status is not RequestStatus.QUEUED:  # admitted: counted in the gauges until now
            if status is RequestStatus.ROUTED:  # no token yet
                self.metrics.queue_depth.dec()
            self.metrics.requests_in_flight.dec()

    def _fail(self, handle: RequestHandle, message: str, status_code: int) -> None:
        if handle.is_done:
            return
        self._finish(handle, f"failed ({status_code})", message)
        handle.queue.put_nowait(RequestFailed(message, status_code))

    def _views(self, prompt: PromptHashes | None = None) -> list[WorkerView]:
        names = {w.worker_id for w in self.registry.live_workers() if w.model_name == self.model_name}
        return [view for view in self.registry.views(prompt) if view.worker_id in names]

    # ------------------------------------------------------------------ worker messages

    def _send(self, worker_id: str, msg: msgspec.Struct) -> bool:
        return self.socket.send(worker_id, msg)

    def _on_message(self, worker_id: str, msg: WorkerToRouter) -> None:
        if isinstance(msg, TokenBatch):
            self.delivery.on_token_batch(worker_id, msg)
        elif isinstance(msg, Heartbeat):
            if msg.worker_id != worker_id:
                self.socket.count_bad_frame(worker_id, f"heartbeat for {msg.worker_id!r} from routing id {worker_id!r}")
            elif self.registry.heartbeat(msg) is None:
                self._send(worker_id, RegisterAck(accepted=False, reregister=True, error="unknown worker: register again"))
            else:
                self.admission.wake()  # its load (or its being alive again) may let a queued request in
        elif isinstance(msg, RegisterWorker):
            self._on_register(worker_id, msg)
        elif isinstance(msg, HandoffOffer):
            if msg.worker_id != worker_id:
                self.socket.count_bad_frame(worker_id, f"handoff offer for {msg.worker_id!r} from routing id {worker_id!r}")
            else:
                self.migration.on_handoff_offer(worker_id, msg)
        elif isinstance(msg, KVEvents):
            if msg.worker_id != worker_id:
                self.socket.count_bad_frame(worker_id, f"KV events for {msg.worker_id!r} from routing id {worker_id!r}")
            elif not self.registry.kv_events(msg):  # unknown to the index (or events lost): start over from a snapshot
                self._send(worker_id, RegisterAck(accepted=False, reregister=True,
                                                  error="KV index out of step: register again"))

    def _on_worker_dead(self, worker: WorkerInfo) -> None:
        self.migration.on_worker_dead(worker)
        self.admission.wake()  # queued requests that only this worker could serve now fail (503)

    def _on_register(self, worker_id: str, msg: RegisterWorker) -> None:
        error = registration_refusal(worker_id, msg, self.model_name)
        if error is not None:
            logger.error("rejected worker %s: %s", worker_id, error)
            self._send(worker_id, RegisterAck(accepted=False, error=error))
            return
        self.registry.register(msg)
        self._send(worker_id, RegisterAck(accepted=True, heartbeat_interval_s=self.registry.heartbeat_interval_s))
        self.admission.wake()

    async def _housekeeping_loop(self) -> None:
        interval = min(0.25, self.registry.heartbeat_interval_s / 2)
        while True:
            slept_from = time.monotonic()
            await asyncio.sleep(interval)
            self.metrics.event_loop_lag_seconds.observe(max(0.0, time.monotonic() - slept_from - interval))
            try:
                self.registry.check_liveness()
                now = time.monotonic()
                for handle in self.in_flight.handles():
                    if now > handle.deadline + 5.0:  # its consumer vanished without cancelling
                        self.cancel(handle)
            except Exception:
                logger.exception("router housekeeping failed")
