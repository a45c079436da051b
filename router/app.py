"""The router's HTTP app (OpenAI-compatible) and its entry point ``run_router``.

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (``router.responses_api``),
GET /v1/models (and /v1/models/{id}), and vLLM's POST /tokenize,
POST /detokenize, GET /tokenizer_info (``router.tokenize``) (these take an optional
``Authorization: Bearer <api_key>``), GET /health (the process is up), GET /ready (per
worker: alive, pid, how long its current step has run, draining; 200 only when live workers can serve a request: any PrefillAndDecode or DecodeOnly worker, the latter prefilling
locally when no PrefillOnly worker is alive; 503 with the reason otherwise), GET /metrics (Prometheus).

Under load the router bends rather than breaks: requests wait in a bounded queue while every worker
runs a full batch, and beyond it get 429 with ``Retry-After`` (see ``router.admission``). On SIGTERM
``run_router`` drains: it stops accepting connections, lets requests in flight finish for up to
``drain_timeout_s``, and only then stops the dispatcher; then it exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from pipeline import tracing
from pipeline.config import PipelineConfig
from pipeline.sign_of_life import SignOfLife
from router.api_keys import ApiKeyCheck
from router.body_limit import BodyLimitMiddleware
from router.dispatcher import Dispatcher
from router.errors import APIError, install_error_handlers
from router.metrics import CONTENT_TYPE, RouterMetrics
from router.openai_schema import ChatCompletionRequest, CompletionRequest
from router.preprocess import prepare_chat, prepare_completion
from router.registry import WorkerRegistry
from router.rejections import RejectionCounter
from router.request_trace import trace_rejection
from router.responses_api import install_responses_route
from router.served_model import ServedModel, keep_torch_out, load_served_model
from router.serving import RouterState, serve
from router.tokenize import install_tokenizer_routes
from router.tokenizer_thread import run_tokenizer_work

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")  # counted in tandem_requests_total


def create_app(
    config: PipelineConfig,
    api_key: str | list[str] | None = None,
    model_path: str | None = None,
    *,
    served_model: ServedModel | None = None,
    heartbeat_interval_s: float | None = None,
    dead_after_s: float | None = None,
    request_timeout_s: float | None = None,
    max_queued_requests: int | None = None,
    queue_timeout_s: float | None = None,
    max_attempts: int = 2,
) -> FastAPI:
    """Build the router app. The ZMQ socket binds when the app starts (lifespan), not here.

    ``model_path`` (default ``config.model.model_path``; both None: the built-in model, which must
    already be built) is the checkpoint whose tokenizer and ``config.json`` the router reads; the served
    name is ``served_model_name(model_path)``, which workers must register with (they derive it the
    same way from their config). ``served_model`` replaces loading (tests share one tokenizer).
    Timings and admission limits left None come from ``config.router`` (the heartbeat interval from
    ``config.transfer``); ``max_attempts`` is how often a request is sent before it fails. ``api_key``:
    one key or several (any of them is accepted: rotate by adding the new one, then removing the old).
    """
    router_config = config.router
    model = served_model or load_served_model(model_path or config.model.model_path, max_length=config.max_length,
                                              served_names=config.model.served_model_name)
    registry = WorkerRegistry(
        heartbeat_interval_s=_or(heartbeat_interval_s, config.transfer.heartbeat_interval_s),
        dead_after_s=_or(dead_after_s, router_config.dead_after_s),
        forget_after_s=max(router_config.forget_dead_worker_after_s, router_config.wait_for_worker_s),
    )
    metrics = RouterMetrics(registry)
    registry.on_worker_registered = metrics.per_worker.add_worker  # its series from 0: rate() sees its first requests
    registry.on_worker_forgotten = metrics.forget_worker
    dispatcher = Dispatcher(
        config.zmq_endpoint_base, registry, metrics, model.checkpoint_name, max_attempts=max_attempts,
        max_queued_requests=_or(max_queued_requests, router_config.max_queued_requests),
        queue_timeout_s=_or(queue_timeout_s, router_config.queue_timeout_s),
        max_local_prefill_length=router_config.max_local_prefill_length,
        prefill_spill_tokens=router_config.prefill_spill_tokens,
        kv_overlap_weight=router_config.kv_overlap_weight if router_config.kv_aware_routing else None,
        max_migrations=router_config.max_migrations,
        wait_for_worker_s=router_config.wait_for_worker_s,
        warm_prefill_cache=router_config.warm_prefill_cache,
        early_prefill=router_config.early_prefill,
    )
    state = RouterState(model, dispatcher, metrics, config.sampling,
                        _or(request_timeout_s, router_config.request_timeout_s))

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await dispatcher.start()
        beating = asyncio.create_task(SignOfLife().beat_from_event_loop())  # for the launcher's watchdog
        try:
            yield
        finally:
            beating.cancel()
            await dispatcher.stop()

    app = FastAPI(title="Tandem router", lifespan=lifespan)
    app.state.router = state
    # innermost first: the API keys inside CORS (whose preflight needs none), the body limit and the rejection count
    app.add_middleware(ApiKeyCheck, api_keys=[api_key] if isinstance(api_key, str) else list(api_key or []))
    origins = [o.strip() for o in router_config.cors_allowed_origins.split(",") if o.strip()]
    if origins:  # browsers' preflight (OPTIONS) answered; the API key check still applies to the request itself
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"],
                           allow_credentials=router_config.cors_allow_credentials)
    install_error_handlers(app, on_error=lambda: metrics.requests_total.labels("error").inc())
    app.add_middleware(BodyLimitMiddleware, max_mib=router_config.max_request_body_mib)

    def on_rejected(status: int, scope: dict, arrived_ns: int) -> None:
        metrics.requests_total.labels("rejected").inc()
        trace_rejection(status, scope, arrived_ns)

    app.add_middleware(RejectionCounter, on_rejected=on_rejected, paths=GENERATION_PATHS)
    created = int(time.time())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        context_length = servable_length()
        prepared = await run_tokenizer_work(lambda: prepare_completion(body, model, config.sampling, context_length))
        return await serve(state, request, prepared, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        context_length = servable_length()
        prepared = await run_tokenizer_work(lambda: prepare_chat(body, model, config.sampling, config.router,
                                                                 context_length))
        return await serve(state, request, prepared, "chat")

    def servable_length() -> int | None:
        """The model's context, or less where every live decode-capable worker's KV pool holds less (a longer
        prompt is a 400 context_length_exceeded: clients that size prompts by this field stay under it)."""
        pools = [w.max_length for w in registry.live_workers()
                 if w.can_decode and w.model_name == model.checkpoint_name]
        longest = max(pools, default=None)
        return model.max_length if longest is None or not model.max_length else min(model.max_length, longest)

    install_tokenizer_routes(app, model, servable_length)
    async def prepare_responses_chat(chat: ChatCompletionRequest):
        context_length = servable_length()  # read on the event loop, as the registry is
        return await run_tokenizer_work(lambda: prepare_chat(chat, model, config.sampling, config.router,
                                                             context_length))

    install_responses_route(app, state, prepare_responses_chat)

    def model_card(served_name: str) -> dict[str, Any]:
        card = {"id": served_name, "object": "model", "created": created, "owned_by": "tandem"}
        if (max_length := servable_length()):
            card["max_model_len"] = max_length
        if model.root:
            card["root"] = model.root
        return card

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name) for name in model.names]}

    @app.get("/v1/models/{model_id:path}")  # the SDK's models.retrieve; ids may hold "/"
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        if not model.serves(model_id):
            raise APIError(404, f"The model `{model_id}` does not exist. This server serves `{model.name}`.",
                           param="model", code="model_not_found")
        return model_card(model_id)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        is_ready, reason = registry.readiness()
        workers = [
            {"worker_id": w.worker_id, "role": w.role.value, "alive": w.is_alive, "pid": w.pid,
             "rank_pids": w.rank_pids,  # a tensor-parallel worker's ranks 1..N-1 (``pid`` is rank 0)
             "busy_in_step_s": round(w.load.busy_in_step_s, 3), "draining": w.load.is_draining}
            for w in registry.all_workers()
        ]
        body = {"ready": is_ready, "reason": reason, "pid": os.getpid(), "workers": workers}  # pid: whose answer
        return JSONResponse(body, status_code=200 if is_ready else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def _or(override, default):
    return default if override is None else override


def run_router(
    config: PipelineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | list[str] | None = None,
    model_path: str | None = None,
    ssl_keyfile: str | None = None,
    ssl_certfile: str | None = None,
    **app_options: Any,
) -> None:
    """Serve the router until interrupted (blocking). ``app_options`` go to ``create_app``; with
    ``ssl_keyfile`` and ``ssl_certfile`` (PEM) it serves HTTPS (uvicorn's TLS).

    SIGTERM (or Ctrl-C) drains: uvicorn stops accepting connections at once, lets the requests in
    flight (streams included) finish for up to ``config.drain_timeout_s`` (a second Ctrl-C ends
    that wait), then cancels what is left; the dispatcher, which the streams need, stops only after
    that (app lifespan shutdown), and the process exits 0. Call it in a process of its own: it first
    marks torch unavailable (``keep_torch_out``) so that loading the tokenizer does not pull torch in.
    """
    import uvicorn

    from router.draining_server import DrainingServer

    if not keep_torch_out():
        logger.warning("torch or transformers was imported before run_router: the router process holds torch")
    if bool(ssl_keyfile) != bool(ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together (the certificate and its private key)")
    app = create_app(config, api_key=api_key, model_path=model_path, **app_options)
    tracing.configure(config.otlp_traces_endpoint, "tandem-router", worker_id="router")
    scheme = "https" if ssl_certfile else "http"
    logger.info("router serving %s on %s://%s:%d", app.state.router.model.name, scheme, host, port)
    previous = _exit_zero_on_sigterm()
    server = DrainingServer(uvicorn.Config(
        app, host=host, port=port, log_level="info", access_log=False,
        timeout_keep_alive=config.router.http_keep_alive_s, ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile),
        config.drain_timeout_s, app.state.router.dispatcher)
    try:
        server.run()
    finally:
        tracing.shutdown()  # the spans still batched go out before the process ends
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _exit_zero_on_sigterm():
    """Make SIGTERM end the process with exit code 0; returns the previous handler (None: not ours to set).

    uvicorn drains on SIGTERM, then raises the signal again once done, so that the default action would
    report a clean drain as death by signal; the workers exit 0 after theirs, and so does the router.
    Before uvicorn runs (the tokenizer loads) SIGTERM exits at once. Only the main thread sets handlers.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
