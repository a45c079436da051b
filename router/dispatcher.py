"""Requests in flight between the HTTP layer and the workers: routing, token delivery, cancels, retries.

Worker messages arrive through ``WorkerSocket`` (registration, heartbeats, token batches) and requests
and cancels leave through it. Everything runs on the HTTP server's event loop, so no locks.

Each request has a ``RequestHandle`` with an asyncio queue that receives its ``TokenDelta``s, or one
``RequestFailed`` when the request cannot finish. When a worker dies (missed heartbeats, a send that
cannot reach it, or an error it marks retryable), a request that has received no token yet is sent
again to another route under a fresh wire id (so late messages of the old attempt cannot mix in);
otherwise it fails. A heartbeat that claims another worker's id counts as a bad frame.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

from pipeline.endpoints import router_endpoint
from pipeline.protocol.cluster import (
    PROTOCOL_VERSION,
    CancelRequest,
    FinishCode,
    GenerateRequest,
    Heartbeat,
    RegisterAck,
    RegisterWorker,
    TokenBatch,
    TokenDelta,
    WorkerRole,
    WorkerToRouter,
)
from pipeline.protocol.requests import SamplingParams
from router.metrics import RouterMetrics
from router.policy import NoRoute, Route, WorkerView, choose_route
from router.registry import WorkerInfo, WorkerRegistry
from router.worker_socket import WorkerSocket

logger = logging.getLogger(__name__)

_MAX_REMEMBERED_CANCELS = 4096


@dataclass
class RequestFailed:
    """Put into a request's queue instead of a delta: the request cannot finish."""

    message: str
    status_code: int = 503  # 503: capacity / worker loss; 500: the worker reported an error


@dataclass
class RequestHandle:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    deadline: float  # time.monotonic() after which the request fails
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    wire_id: str = ""
    decode_worker_id: str | None = None
    prefill_worker_id: str | None = None
    num_attempts: int = 0
    has_tokens: bool = False
    is_done: bool = False
    created_at: float = field(default_factory=time.monotonic)
    last_token_at: float = 0.0
    _inflight_on: str | None = None  # the decode worker whose num_inflight counts this request
    _pending_prefill: tuple[str, int] | None = None  # (prefill worker, prompt tokens) counted there

    async def next(self) -> TokenDelta | RequestFailed:
        """The next delta or failure; raises TimeoutError once the deadline passed."""
        if not self.queue.empty():  # the common case under load: no timer, no task
            return self.queue.get_nowait()
        return await asyncio.wait_for(self.queue.get(), timeout=max(0.0, self.deadline - time.monotonic()))


class Dispatcher:
    def __init__(
        self,
        zmq_endpoint_base: str,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        model_name: str,
        max_attempts: int = 2,
    ) -> None:
        self.socket = WorkerSocket(router_endpoint(zmq_endpoint_base), self._on_message, metrics.bad_frames_total.inc)
        self.registry = registry
        self.metrics = metrics
        self.model_name = model_name
        self.max_attempts = max_attempts
        self._requests: dict[str, RequestHandle] = {}  # wire id -> handle
        self._cancelled: OrderedDict[str, None] = OrderedDict()  # wire ids we cancelled: ignore their deltas
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
        for handle in list(self._requests.values()):
            self._fail(handle, "the router is shutting down", 503)
        await self.socket.stop()

    @property
    def num_bad_frames(self) -> int:
        return self.socket.num_bad_frames

    # ------------------------------------------------------------------ requests

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, timeout_s: float) -> RequestHandle:
        """Route and send a request; raises ``NoRoute`` when no worker can take it."""
        handle = RequestHandle(request_id, prompt_token_ids, params, deadline=time.monotonic() + timeout_s)
        self._dispatch(handle, exclude=set())
        self.metrics.queue_depth.inc()
        self.metrics.requests_in_flight.inc()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """The client is gone or a stop string matched: stop the worker, forget the request."""
        if handle.is_done:
            return
        if handle.decode_worker_id is not None:
            self._send(handle.decode_worker_id, CancelRequest(request_id=handle.wire_id))
        self._remember_cancel(handle.wire_id)
        self._finish(handle)

    def _dispatch(self, handle: RequestHandle, exclude: set[str]) -> None:
        needed = len(handle.prompt_token_ids) + (handle.sampling_params.max_tokens or 0)
        while True:
            route = choose_route(self._views(), needed, exclude)  # raises NoRoute
            handle.num_attempts += 1
            handle.wire_id = handle.request_id if handle.num_attempts == 1 else f"{handle.request_id}~{handle.num_attempts}"
            msg = GenerateRequest(
                request_id=handle.wire_id,
                prompt_token_ids=handle.prompt_token_ids,
                sampling_params=handle.sampling_params,
                prefill_worker_id=route.prefill.worker_id if route.prefill else None,
                prefill_endpoint=route.prefill.prefill_endpoint if route.prefill else None,
                deadline_s=max(0.001, handle.deadline - time.monotonic()),
            )
            if self._send(route.decode.worker_id, msg):
                self._assign(handle, route)
                return
            exclude.add(route.decode.worker_id)

    def _assign(self, handle: RequestHandle, route: Route) -> None:
        handle.decode_worker_id = route.decode.worker_id
        handle.prefill_worker_id = route.prefill.worker_id if route.prefill else None
        self._requests[handle.wire_id] = handle
        decode = self.registry.get(route.decode.worker_id)
        if decode is not None:
            decode.num_inflight += 1
            handle._inflight_on = decode.worker_id
        if route.prefill is not None:
            prefill = self.registry.get(route.prefill.worker_id)
            if prefill is not None:
                prefill.num_pending_prefill_tokens += len(handle.prompt_token_ids)
                handle._pending_prefill = (prefill.worker_id, len(handle.prompt_token_ids))

    def _unassign(self, handle: RequestHandle) -> None:
        self._requests.pop(handle.wire_id, None)
        self._release_prefill(handle)
        decode = self.registry.get(handle._inflight_on) if handle._inflight_on else None
        handle._inflight_on = None
        if decode is not None:
            decode.num_inflight = max(0, decode.num_inflight - 1)

    def _release_prefill(self, handle: RequestHandle) -> None:
        if handle._pending_prefill is not None:
            worker_id, num_tokens = handle._pending_prefill
            handle._pending_prefill = None
            prefill = self.registry.get(worker_id)
            if prefill is not None:
                prefill.num_pending_prefill_tokens = max(0, prefill.num_pending_prefill_tokens - num_tokens)

    def _finish(self, handle: RequestHandle) -> None:
        if handle.is_done:
            return
        self._unassign(handle)
        handle.is_done = True
        if not handle.has_tokens:
            self.metrics.queue_depth.dec()
        self.metrics.requests_in_flight.dec()

    def _fail(self, handle: RequestHandle, message: str, status_code: int) -> None:
        if handle.is_done:
            return
        self._finish(handle)
        handle.queue.put_nowait(RequestFailed(message, status_code))

    def _retry_or_fail(self, handle: RequestHandle, failed_worker: str, message: str, status_code: int = 503) -> None:
        """Send the request elsewhere if no token of it exists yet and attempts remain; else fail it."""
        if handle.is_done:
            return
        if handle.has_tokens or handle.num_attempts >= self.max_attempts or time.monotonic() >= handle.deadline:
            self._fail(handle, message, status_code)
            return
        old_decode = handle.decode_worker_id
        if old_decode and old_decode != failed_worker and self.registry.is_alive(old_decode):
            self._send(old_decode, CancelRequest(request_id=handle.wire_id))
        self._remember_cancel(handle.wire_id)
        self._unassign(handle)
        try:
            self._dispatch(handle, exclude={failed_worker})
        except NoRoute as exc:
            self._fail(handle, f"{message}; no other worker to retry on ({exc})", status_code)
            return
        self.metrics.retries_total.inc()
        logger.info("request %s retried as %s after: %s", handle.request_id, handle.wire_id, message)

    def _on_worker_dead(self, worker: WorkerInfo) -> None:
        for handle in list(self._requests.values()):
            if handle.decode_worker_id == worker.worker_id:
                self._retry_or_fail(handle, worker.worker_id, f"decode worker {worker.worker_id} died")
            elif handle.prefill_worker_id == worker.worker_id and not handle.has_tokens:
                self._retry_or_fail(handle, worker.worker_id, f"prefill worker {worker.worker_id} died")

    def _views(self) -> list[WorkerView]:
        return [w.view() for w in self.registry.live_workers() if w.model_name == self.model_name]

    # ------------------------------------------------------------------ worker messages

    def _send(self, worker_id: str, msg: msgspec.Struct) -> bool:
        return self.socket.send(worker_id, msg)

    def _remember_cancel(self, wire_id: str) -> None:
        self._cancelled[wire_id] = None
        while len(self._cancelled) > _MAX_REMEMBERED_CANCELS:
            self._cancelled.popitem(last=False)

    def _on_message(self, worker_id: str, msg: WorkerToRouter) -> None:
        if isinstance(msg, TokenBatch):
            self._on_token_batch(worker_id, msg)
        elif isinstance(msg, Heartbeat):
            if msg.worker_id != worker_id:
                self.socket.count_bad_frame(worker_id, f"heartbeat for {msg.worker_id!r} from routing id {worker_id!r}")
            elif self.registry.heartbeat(msg) is None:
                self._send(worker_id, RegisterAck(accepted=False, reregister=True, error="unknown worker: register again"))
        elif isinstance(msg, RegisterWorker):
            self._on_register(worker_id, msg)

    def _on_register(self, worker_id: str, msg: RegisterWorker) -> None:
        error = None
        if msg.worker_id != worker_id:
            error = f"worker_id {msg.worker_id!r} differs from the socket routing id {worker_id!r}"
        elif msg.protocol_version != PROTOCOL_VERSION:
            error = f"protocol version {msg.protocol_version} != router's {PROTOCOL_VERSION}"
        elif msg.model_name != self.model_name:
            error = f"model {msg.model_name!r} differs from the router's {self.model_name!r}"
        elif msg.role == WorkerRole.PREFILL_ONLY and not msg.prefill_endpoint:
            error = "a PrefillOnly worker must report its prefill_endpoint"
        if error is not None:
            logger.error("rejected worker %s: %s", worker_id, error)
            self._send(worker_id, RegisterAck(accepted=False, error=error))
            return
        self.registry.register(msg)
        self._send(worker_id, RegisterAck(accepted=True, heartbeat_interval_s=self.registry.heartbeat_interval_s))

    def _on_token_batch(self, worker_id: str, batch: TokenBatch) -> None:
        self.registry.touch(worker_id)
        now = time.monotonic()
        for delta in batch.outputs:
            handle = self._requests.get(delta.request_id)
            if handle is None or handle.decode_worker_id != worker_id:
                if delta.finish_reason is None and delta.request_id not in self._cancelled:
                    self._remember_cancel(delta.request_id)
                    self._send(worker_id, CancelRequest(request_id=delta.request_id))
                continue
            if delta.finish_reason == FinishCode.ERROR and delta.retryable and not delta.token_ids:
                self._retry_or_fail(handle, worker_id, f"worker {worker_id}: {delta.error or 'error'}", 503)
                continue
            if delta.token_ids:
                if not handle.has_tokens:
                    handle.has_tokens = True
                    self._release_prefill(handle)
                    self.metrics.queue_depth.dec()
                    self.metrics.ttft_seconds.observe(now - handle.created_at)
                else:  # tokens that arrive together share the gap since the previous ones
                    gap = (now - handle.last_token_at) / len(delta.token_ids)
                    for _ in delta.token_ids:
                        self.metrics.itl_seconds.observe(gap)
                handle.last_token_at = now
            handle.queue.put_nowait(delta)
            if delta.finish_reason is not None:
                self._finish(handle)

    async def _housekeeping_loop(self) -> None:
        interval = min(0.25, self.registry.heartbeat_interval_s / 2)
        while True:
            await asyncio.sleep(interval)
            try:
                self.registry.check_liveness()
                now = time.monotonic()
                for handle in list(self._requests.values()):
                    if now > handle.deadline + 5.0:  # its consumer vanished without cancelling
                        self.cancel(handle)
            except Exception:
                logger.exception("router housekeeping failed")
