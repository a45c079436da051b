"""One request's life in the router after validation: admit, dispatch, stream or collect, stop, cancel, time out.

Admission comes first and ends before any response starts: a request that finds every worker busy
waits in the dispatcher's admission queue (a client that leaves meanwhile leaves the queue), and one
that cannot wait gets 429 with ``Retry-After`` at once. Streaming answers are Server-Sent Events
ending with ``data: [DONE]``; a failure after the response started is sent as one
``data: {"error": {...}}`` event (the openai client raises it as an APIError) before ``[DONE]``.
The worker gets a ``CancelRequest`` whenever the router stops listening before the worker finished:
client disconnect, stop string, timeout, error. A completions request with a list of prompts is one
worker request per prompt, answered as one response (choices by prompt index; streamed chunks
interleave as the prompts produce them); any prompt's failure fails the whole response.
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
from router.streaming import ChoiceResult, LogprobEntry, OutputBuilder, Piece, ResponseShape, total_usage

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


async def serve(state: RouterState, http_request: Request, prompts: list[PreparedRequest], kind: str) -> Response:
    """One response for one or more prompts (a completions request may carry a list): each prompt is its
    own request to the workers, admitted before the response starts; choice ``index`` is the prompt's."""
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    handles = await _admit_all(state, http_request, request_id, prompts)
    if handles is None:
        return Response(status_code=499)  # the client left while waiting; nobody reads this
    first = prompts[0]
    shape = ResponseShape(kind, request_id, state.model.name, first.want_logprobs)
    choices = [_Choice(i, handle, OutputBuilder(state.model, p.params, len(p.prompt_token_ids), p.prompt))
               for i, (handle, p) in enumerate(zip(handles, prompts))]
    if first.stream:
        return StreamingResponse(
            _stream(state, choices, shape, first.include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await _collect_unless_disconnected(state, http_request, choices, shape)


@dataclass
class _Choice:
    index: int
    handle: RequestHandle
    builder: OutputBuilder


async def _admit_all(state: RouterState, http_request: Request, request_id: str,
                     prompts: list[PreparedRequest]) -> list[RequestHandle] | None:
    """Submit every prompt and wait until all are admitted (None: the client left meanwhile). A 429 or
    503 for any of them cancels the others: a response is all its prompts or an error."""
    handles: list[RequestHandle] = []
    try:
        for i, prepared in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            handles.append(state.dispatcher.submit(rid, prepared.prompt_token_ids, prepared.params,
                                                   state.request_timeout_s))
        waiting = [state.dispatcher.wait_admitted(h) for h in handles if not h.is_admitted]
        if waiting:  # every worker is busy: wait in the queue, unless the client leaves
            await _unless_disconnected(http_request, asyncio.gather(*waiting))
    except Overloaded as exc:
        _cancel_all(state, handles, None)
        state.metrics.requests_total.labels("overloaded").inc()
        raise overloaded(str(exc), exc.retry_after_s) from None
    except NoRoute as exc:
        _cancel_all(state, handles, None)
        state.metrics.requests_total.labels("unavailable").inc()
        raise APIError(503, f"no worker can serve this request: {exc}") from None
    except _ClientGone:
        _cancel_all(state, handles, "cancelled")
        return None
    except BaseException:
        _cancel_all(state, handles, None)
        raise
    return handles


def _cancel_all(state: RouterState, handles: list[RequestHandle], outcome: str | None) -> None:
    for handle in handles:
        if not handle.is_done:
            state.dispatcher.cancel(handle)
            if outcome is not None:
                state.metrics.requests_total.labels(outcome).inc()


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


async def _pieces(state: RouterState, choice: _Choice, out: asyncio.Queue) -> None:
    """Feed one choice's pieces (then None, or the APIError that ended it) into the shared queue."""
    try:
        while not choice.builder.is_finished:
            await out.put((choice.index, await _next_piece(state, choice.handle, choice.builder)))
        await out.put((choice.index, None))
    except APIError as error:
        await out.put((choice.index, error))


async def _stream(state: RouterState, choices: list[_Choice], shape: ResponseShape,
                  include_usage: bool) -> AsyncIterator[bytes]:
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pieces(state, choice, queue)) for choice in choices]
    try:
        if shape.kind == "chat":
            for choice in choices:
                yield _sse(shape.chunk(Piece(), first=True, index=choice.index))
        remaining = len(choices)
        failed = False
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, APIError):
                yield _error_event(item)  # one failed prompt fails the response: the others are cancelled
                failed = True
                break
            elif item.text or item.logprobs or item.finish_reason is not None:
                yield _sse(shape.chunk(item, index=index))
        if not failed and include_usage:
            yield _sse(shape.usage_chunk(total_usage([c.builder.usage() for c in choices])))
        yield b"data: [DONE]\n\n"
    finally:  # also runs when the client disconnects (the generator is closed at a yield or await)
        for task in tasks:
            task.cancel()
        _cancel_all(state, [c.handle for c in choices], "cancelled")


async def _collect_one(state: RouterState, choice: _Choice) -> ChoiceResult:
    builder = choice.builder
    text_parts: list[str] = []
    entries: list[LogprobEntry] = []
    stop_reason = None
    prompt_logprobs = None
    while not builder.is_finished:
        piece = await _next_piece(state, choice.handle, builder)
        text_parts.append(piece.text)
        entries.extend(piece.logprobs)
        if piece.prompt_logprobs is not None:
            prompt_logprobs = piece.prompt_logprobs
        if piece.finish_reason is not None:
            stop_reason = piece.stop_reason
    return ChoiceResult(choice.index, "".join(text_parts), entries, builder.finish_reason, stop_reason,
                        prompt_logprobs)


async def _collect(state: RouterState, choices: list[_Choice], shape: ResponseShape) -> dict:
    tasks = [asyncio.ensure_future(_collect_one(state, choice)) for choice in choices]
    try:
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return shape.full(results, total_usage([c.builder.usage() for c in choices]))


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
    state: RouterState, http_request: Request, choices: list[_Choice], shape: ResponseShape
) -> Response:
    try:
        body = await _unless_disconnected(http_request, _collect(state, choices, shape))
    except _ClientGone:
        return Response(status_code=499)  # nobody reads this
    finally:
        _cancel_all(state, [c.handle for c in choices], "cancelled")
    return JSONResponse(body)
