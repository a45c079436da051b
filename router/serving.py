"""One request's life in the router after validation: dispatch, stream or collect, stop, cancel, time out.

Streaming answers are Server-Sent Events ending with ``data: [DONE]``; a failure after the response
started is sent as one ``data: {"error": {...}}`` event (the openai client raises it as an APIError)
before ``[DONE]``. The worker gets a ``CancelRequest`` whenever the router stops listening before the
worker finished: client disconnect, stop string, timeout, error.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pipeline.config import SamplingConfig
from router.dispatcher import Dispatcher, RequestFailed, RequestHandle
from router.errors import APIError
from router.metrics import RouterMetrics
from router.policy import NoRoute
from router.preprocess import PreparedRequest
from router.served_model import ServedModel
from router.streaming import LogprobEntry, OutputBuilder, Piece, ResponseShape

logger = logging.getLogger(__name__)

_json = msgspec.json.Encoder()


@dataclass
class RouterState:
    model: ServedModel
    dispatcher: Dispatcher
    metrics: RouterMetrics
    sampling_defaults: SamplingConfig
    request_timeout_s: float


def _sse(payload: dict) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


def _error_event(error: APIError) -> bytes:
    return _sse(error.body())


def _failure_error(item: RequestFailed) -> APIError:
    return APIError(item.status_code, item.message)


def _timeout_error(state: RouterState) -> APIError:
    return APIError(504, f"the request did not finish within {state.request_timeout_s:g} s", code="timeout")


async def serve(state: RouterState, http_request: Request, prepared: PreparedRequest, kind: str) -> Response:
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    try:
        handle = state.dispatcher.submit(
            request_id, prepared.prompt_token_ids, prepared.params, state.request_timeout_s
        )
    except NoRoute as exc:
        state.metrics.requests_total.labels("unavailable").inc()
        raise APIError(503, f"no worker can serve this request: {exc}") from None
    shape = ResponseShape(kind, request_id, state.model.name, prepared.want_logprobs)
    builder = OutputBuilder(state.model, prepared.params, len(prepared.prompt_token_ids))
    if prepared.stream:
        return StreamingResponse(
            _stream(state, handle, builder, shape, prepared.include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await _collect_unless_disconnected(state, http_request, handle, builder, shape)


async def _next_piece(state: RouterState, handle: RequestHandle, builder: OutputBuilder) -> Piece:
    """Wait for the next delta and render it; failures become APIError (and stop the worker)."""
    try:
        item = await handle.next()
    except (asyncio.TimeoutError, TimeoutError):
        state.dispatcher.cancel(handle)
        state.metrics.requests_total.labels("timeout").inc()
        raise _timeout_error(state) from None
    if isinstance(item, RequestFailed):
        state.metrics.requests_total.labels("error").inc()
        raise _failure_error(item)
    piece = builder.add(item)
    if piece.error is not None:
        state.dispatcher.cancel(handle)
        state.metrics.requests_total.labels("error").inc()
        raise APIError(500, f"generation failed: {piece.error}")
    if piece.matched_stop_string:
        state.dispatcher.cancel(handle)  # the worker does not know the router stopped it
    if builder.is_finished:
        state.metrics.requests_total.labels("ok").inc()
    return piece


async def _stream(
    state: RouterState, handle: RequestHandle, builder: OutputBuilder, shape: ResponseShape, include_usage: bool
) -> AsyncIterator[bytes]:
    try:
        if shape.kind == "chat":
            yield _sse(shape.chunk(Piece(), first=True))
        while not builder.is_finished:
            try:
                piece = await _next_piece(state, handle, builder)
            except APIError as error:
                yield _error_event(error)
                break
            if piece.text or piece.logprobs or piece.finish_reason is not None:
                yield _sse(shape.chunk(piece))
        if builder.is_finished and include_usage:
            yield _sse(shape.usage_chunk(builder.usage()))
        yield b"data: [DONE]\n\n"
    finally:  # also runs when the client disconnects (the task is cancelled at an await)
        if not handle.is_done:
            state.dispatcher.cancel(handle)
            state.metrics.requests_total.labels("cancelled").inc()


async def _collect(state: RouterState, handle: RequestHandle, builder: OutputBuilder, shape: ResponseShape) -> dict:
    text_parts: list[str] = []
    entries: list[LogprobEntry] = []
    stop_reason = None
    while not builder.is_finished:
        piece = await _next_piece(state, handle, builder)
        text_parts.append(piece.text)
        entries.extend(piece.logprobs)
        if piece.finish_reason is not None:
            stop_reason = piece.stop_reason
    return shape.full("".join(text_parts), entries, builder.finish_reason, stop_reason, builder.usage())


async def _wait_for_disconnect(http_request: Request) -> None:
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect_unless_disconnected(
    state: RouterState, http_request: Request, handle: RequestHandle, builder: OutputBuilder, shape: ResponseShape
) -> Response:
    collect = asyncio.ensure_future(_collect(state, handle, builder, shape))
    watch = asyncio.ensure_future(_wait_for_disconnect(http_request))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collect, watch):
            if not task.done():
                task.cancel()  # finishes on the loop's next turn; nothing awaits it
        if not handle.is_done:
            state.dispatcher.cancel(handle)
            state.metrics.requests_total.labels("cancelled").inc()
    if not collect.done() or collect.cancelled():
        return Response(status_code=499)  # the client left; nobody reads this
    error = collect.exception()
    if error is not None:
        raise error
    return JSONResponse(collect.result())
