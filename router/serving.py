"""One request's life in the router after validation: admit, dispatch, stream or collect, stop, cancel, time out.

Admission comes first and ends before any response starts: a request that finds every worker busy
waits in the dispatcher's admission queue (a client that leaves meanwhile leaves the queue), and one
that cannot wait gets 429 with ``Retry-After`` at once. Streaming answers are Server-Sent Events
ending with ``data: [DONE]``; a failure after the response started is sent as one
``data: {"error": {...}}`` event (the openai client raises it as an APIError) before ``[DONE]``.
The worker gets a ``CancelRequest`` whenever the router stops listening before the worker finished:
client disconnect, stop string, timeout, error.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Awaitable, AsyncIterator, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pipeline.config import SamplingConfig
from router.admission import Overloaded
from router.dispatcher import Dispatcher
from router.request_handle import RequestFailed, RequestHandle
from router.errors import APIError, overloaded
from router.metrics import RouterMetrics
from router.policy import NoRoute
from router.preprocess import PreparedRequest
from router.served_model import ServedModel
from router.streaming import LogprobEntry, OutputBuilder, Piece, ResponseShape

logger = logging.getLogger(__name__)

_json = msgspec.json.Encoder()

T = TypeVar("T")


class _ClientGone(Exception):
    """The client disconnected before the response was ready."""


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
            request_id, prepared.prompt_token_ids, prepared.params, state.request_timeout_s)
        if not handle.is_admitted:  # every worker is busy: wait in the queue, unless the client leaves
            await _unless_disconnected(http_request, state.dispatcher.wait_admitted(handle))
    except Overloaded as exc:
        state.metrics.requests_total.labels("overloaded").inc()
        raise overloaded(str(exc), exc.retry_after_s) from None
    except NoRoute as exc:
        state.metrics.requests_total.labels("unavailable").inc()
        raise APIError(503, f"no worker can serve this request: {exc}") from None
    except _ClientGone:
        state.dispatcher.cancel(handle)
        state.metrics.requests_total.labels("cancelled").inc()
        return Response(status_code=499)  # nobody reads this
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


async def _unless_disconnected(http_request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first: then ``work`` is cancelled and ``_ClientGone`` raised.

    A plain (non-streaming) handler is not cancelled when its client leaves, so it must watch for that.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(http_request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watch):
            if not pending.done():
                pending.cancel()  # finishes on the loop's next turn; nothing awaits it
    if not task.done() or task.cancelled():
        raise _ClientGone
    return task.result()


async def _collect_unless_disconnected(
    state: RouterState, http_request: Request, handle: RequestHandle, builder: OutputBuilder, shape: ResponseShape
) -> Response:
    try:
        body = await _unless_disconnected(http_request, _collect(state, handle, builder, shape))
    except _ClientGone:
        return Response(status_code=499)  # nobody reads this
    finally:
        if not handle.is_done:
            state.dispatcher.cancel(handle)
            state.metrics.requests_total.labels("cancelled").inc()
    return JSONResponse(body)
