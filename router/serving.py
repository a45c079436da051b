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
import contextlib
import logging
import uuid
from dataclasses import dataclass, replace
from typing import Awaitable, AsyncIterator, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pipeline.config import SamplingConfig
from pipeline.protocol.cluster import FinishCode
from pipeline.protocol.requests import PromptLogprobs
from router.admission import Overloaded
from router.chat_output import ChatOutputFormat, ChatOutputStream
from router.dispatcher import Dispatcher
from router.request_handle import RequestFailed, RequestHandle
from router.request_trace import REQUEST_TRACED
from router.errors import APIError, bad_request, overloaded
from router.metrics import RouterMetrics
from router.policy import NoRoute, PromptTooLong
from router.preprocess import PreparedRequest
from router.served_model import ServedModel
from router.sse import sse_event
from router.streaming import ChoiceResult, OutputBuilder, Piece, ResponseShape, total_usage

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


@dataclass
class RouterState:
    model: ServedModel
    dispatcher: Dispatcher
    metrics: RouterMetrics
    sampling_defaults: SamplingConfig
    request_timeout_s: float


def _sse(payload: dict) -> bytes:
    return sse_event(payload)


def _error_event(error: APIError) -> bytes:
    return _sse(error.body())


def _failure_error(item: RequestFailed) -> APIError:
    return APIError(item.status_code, item.message)


def _timeout_error(state: RouterState) -> APIError:
    return APIError(504, f"the request did not finish within {state.request_timeout_s:g} s", code="timeout")


@dataclass
class Admitted:
    """A request every worker slot of which is granted: its groups (one per prompt) and response shape."""

    groups: list["_Group"]
    shape: ResponseShape
    include_usage: bool
    continuous_usage: bool


async def admit(state: RouterState, http_request: Request, prompts: list[PreparedRequest], kind: str,
                request_id: str | None = None) -> Admitted | None:
    """Submit every prompt of a response and wait until all are admitted (None: the client left
    meanwhile); 429 / 503 before any response starts. ``index`` of a choice is prompt i x n + choice j."""
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    request_id = request_id or f"{prefix}-{uuid.uuid4().hex}"
    handles = await _admit_all(state, http_request, request_id, prompts)
    if handles is None:
        return None
    first = prompts[0]
    shape = ResponseShape(kind, request_id, state.model.name, first.want_logprobs)
    groups = [_Group.of(state, handle, prepared, prompt_index)
              for prompt_index, (handle, prepared) in enumerate(zip(handles, prompts))]
    return Admitted(groups, shape, first.include_usage, first.continuous_usage)


async def serve(state: RouterState, http_request: Request, prompts: list[PreparedRequest], kind: str) -> Response:
    """One response for one or more prompts (a completions request may carry a list), each with n
    choices: each prompt is one request to the workers (its n choices decoded there side by side from
    one prefill), admitted before the response starts."""
    admitted = await admit(state, http_request, prompts, kind)
    if admitted is None:
        return Response(status_code=499)  # the client left while waiting; nobody reads this
    if prompts[0].stream:
        return event_stream(_sse_stream(chunks(state, admitted)))
    body = await collect(state, http_request, admitted)
    return Response(status_code=499) if body is None else JSONResponse(body)


def event_stream(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _sse_stream(items: AsyncIterator[dict | APIError]) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(items):  # a client that leaves closes this, which must close the chunks too
        async for item in items:
            yield _error_event(item) if isinstance(item, APIError) else _sse(item)
    yield b"data: [DONE]\n\n"


@dataclass
class _Choice:
    index: int  # in the response (best_of: renumbered once the best are known)
    builder: OutputBuilder
    output: ChatOutputFormat | None = None  # chat: reasoning and tool calls read out of the text
    stream: ChatOutputStream | None = None

    def delta_fields(self, piece: Piece) -> dict | None:
        """A streamed chat piece's delta fields (None: plain content), its finish reason set as the API shows it."""
        if self.output is None:
            return None
        self.stream = self.stream or self.output.streaming()
        fields = self.stream.feed(piece.text, final=piece.finish_reason is not None)
        piece.finish_reason = self.output.finish_reason(piece.finish_reason, self.stream.made_calls)
        return fields

    def result(self, pieces: list[Piece]) -> ChoiceResult:
        text = "".join(p.text for p in pieces)
        stop_reason = next((p.stop_reason for p in pieces if p.finish_reason is not None), None)
        prompt_logprobs = next((p.prompt_logprobs for p in pieces if p.prompt_logprobs is not None), None)
        finish_reason, message = self.builder.finish_reason, None
        if self.output is not None:
            message = self.output.message(text)
            finish_reason = self.output.finish_reason(finish_reason, bool(message.get("tool_calls")))
        return ChoiceResult(self.index, text, [e for p in pieces for e in p.logprobs], finish_reason, stop_reason,
                            prompt_logprobs, message)


@dataclass
class _Group:
    """One prompt's request at the workers and its choices, by the worker's choice index."""

    handle: RequestHandle
    choices: list[_Choice]
    num_returned: int  # n: best_of candidates beyond it are decoded, then dropped
    is_ranked: bool = False  # best_of: the choices come back most likely first (best_of == n too)
    prompt_logprobs: PromptLogprobs | None = None  # choice 0 brings them; every choice's echo shows them

    @classmethod
    def of(cls, state: RouterState, handle: RequestHandle, prepared: PreparedRequest, prompt_index: int) -> "_Group":
        n = prepared.params.n
        choices = [_Choice(prompt_index * n + j, OutputBuilder(state.model, prepared.params,
                                                                len(prepared.prompt_token_ids), prepared.prompt,
                                                                prepared.tokens_as_ids), prepared.chat_output)
                   for j in range(prepared.params.num_sequences)]
        return cls(handle, choices, n, is_ranked=prepared.params.best_of is not None)

    @property
    def is_finished(self) -> bool:
        return all(c.builder.is_finished for c in self.choices)

    def usage(self) -> dict:
        """The prompt once, every generated token of every choice (best_of candidates included)."""
        usages = [c.builder.usage() for c in self.choices]
        usage = dict(usages[0])
        usage["completion_tokens"] = sum(u["completion_tokens"] for u in usages)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return usage

    def best(self, results: list[ChoiceResult]) -> list[ChoiceResult]:
        """best_of: the n candidates with the highest cumulative logprob, most likely first."""
        if not self.is_ranked:
            return results
        ranked = sorted(zip(results, self.choices), key=lambda rc: -rc[1].builder.cumulative_logprob)
        base = self.choices[0].index
        return [replace(result, index=base + rank) for rank, (result, _) in enumerate(ranked[:self.num_returned])]


async def _admit_all(state: RouterState, http_request: Request, request_id: str,
                     prompts: list[PreparedRequest]) -> list[RequestHandle] | None:
    """Submit every prompt and wait until all are admitted (None: the client left meanwhile). A 429 or
    503 for any of them cancels the others: a response is all its prompts or an error."""
    handles: list[RequestHandle] = []
    try:
        for i, prepared in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            handles.append(state.dispatcher.submit(rid, prepared.prompt_token_ids, prepared.params,
                                                   state.request_timeout_s, priority=prepared.priority,
                                                   trace_parent=http_request.headers, counted=i == 0))
            http_request.scope.setdefault("state", {})[REQUEST_TRACED] = True  # a refusal now ends its trace
        waiting = [state.dispatcher.wait_admitted(h) for h in handles if not h.is_admitted]
        if waiting:  # every worker is busy: wait in the queue, unless the client leaves
            await unless_disconnected(http_request, asyncio.gather(*waiting))
    except Overloaded as exc:
        _cancel_all(state, handles, None, "failed (429)", str(exc))
        state.metrics.requests_total.labels("overloaded").inc()
        raise overloaded(str(exc), exc.retry_after_s) from None
    except PromptTooLong as exc:  # as a prompt past the model's context: the client's to shorten, not to retry
        _cancel_all(state, handles, None, "failed (400)", str(exc))  # counted as rejected by its status
        raise bad_request(f"This model's maximum context length is {exc.longest} tokens on its workers: {exc}",
                          code="context_length_exceeded") from None
    except NoRoute as exc:
        _cancel_all(state, handles, None, "failed (503)", str(exc))
        state.metrics.requests_total.labels("unavailable").inc()
        raise APIError(503, f"no worker can serve this request: {exc}") from None
    except ClientGone:
        _cancel_all(state, handles, "cancelled")
        return None
    except BaseException:
        _cancel_all(state, handles, None)
        raise
    return handles


def _cancel_all(state: RouterState, handles: list[RequestHandle], counted_as: str | None,
                trace_outcome: str = "cancelled", error: str | None = None) -> None:
    """Cancel what is not over; ``counted_as``: the outcome each counts as (None: counted by the caller)."""
    for handle in handles:
        if not handle.is_done:
            state.dispatcher.cancel(handle, trace_outcome, error)
            if counted_as is not None:
                state.metrics.requests_total.labels(counted_as).inc()


async def _next_piece(state: RouterState, group: _Group) -> tuple[_Choice, Piece]:
    """Wait for the group's next delta and render it for its choice; failures become APIError (and
    stop the worker)."""
    handle = group.handle
    while True:
        try:
            item = await handle.next()
        except (asyncio.TimeoutError, TimeoutError):
            error = _timeout_error(state)
            state.dispatcher.cancel(handle, "timeout", error.message)
            state.metrics.requests_total.labels("timeout").inc()
            raise error from None
        if isinstance(item, RequestFailed):  # 503: no worker could carry it on; 500: a worker's error
            state.metrics.requests_total.labels("unavailable" if item.status_code == 503 else "error").inc()
            raise _failure_error(item)
        if not 0 <= item.index < len(group.choices):
            continue
        choice = group.choices[item.index]
        if choice.builder.is_finished:
            # a whole-request error is reported by the first open choice; anything else is a stopped choice's
            choice = next((c for c in group.choices if not c.builder.is_finished), None) \
                if item.finish_reason == FinishCode.ERROR else None
            if choice is None:
                continue
        if item.prompt_logprobs is not None:
            group.prompt_logprobs = item.prompt_logprobs
        elif group.prompt_logprobs is not None and item.token_ids:
            item.prompt_logprobs = group.prompt_logprobs  # choices after the first echo the same prompt
        piece = choice.builder.add(item)
        if piece.error is not None:
            message = f"generation failed: {piece.error}"
            state.dispatcher.cancel(handle, "failed (500)", message)
            state.metrics.requests_total.labels("error").inc()
            raise APIError(500, message)
        if piece.matched_stop_string:  # the worker does not know the router stopped it
            state.dispatcher.cancel_choice(handle, group.choices.index(choice))
        if group.is_finished:
            state.metrics.requests_total.labels("ok").inc()
        return choice, piece


async def _pieces(state: RouterState, group: _Group, out: asyncio.Queue) -> None:
    """Feed one group's pieces (then None, or the APIError that ended it) into the shared queue."""
    try:
        while not group.is_finished:
            choice, piece = await _next_piece(state, group)
            await out.put((choice, piece))
        await out.put((None, None))
    except APIError as error:
        await out.put((None, error))


async def chunks(state: RouterState, admitted: Admitted) -> AsyncIterator[dict | APIError]:
    """The response's chunks as they come (choices interleaved), then the usage chunk when asked for;
    a failure is yielded as the APIError that ends it. Closing it cancels what still runs."""
    groups, shape = admitted.groups, admitted.shape
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pieces(state, group, queue)) for group in groups]
    # a chat choice's role chunk goes out with its first output, as vLLM sends it: sent before the prompt is
    # computed, it would read as the first token to a client timing TTFT (vllm bench serve's chat backend)
    unannounced = {id(choice) for group in groups for choice in group.choices} if shape.kind == "chat" else set()

    def with_usage(chunk: dict) -> dict:  # vLLM's continuous_usage_stats: every chunk, the role's too
        if admitted.continuous_usage:
            chunk["usage"] = total_usage([g.usage() for g in groups])
        return chunk

    try:
        remaining = len(groups)
        failed = False
        while remaining:
            choice, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, APIError):
                yield item  # one failed prompt fails the response: the others are cancelled
                failed = True
                break
            elif item.text or item.logprobs or item.finish_reason is not None:
                if id(choice) in unannounced:
                    unannounced.discard(id(choice))
                    yield with_usage(shape.chunk(Piece(), first=True, index=choice.index))
                fields = choice.delta_fields(item)
                if fields == {} and not item.logprobs and item.finish_reason is None:
                    continue  # held back by a parser: it may be a marker
                yield with_usage(shape.chunk(item, index=choice.index, fields=fields))
        if not failed and admitted.include_usage:
            yield shape.usage_chunk(total_usage([g.usage() for g in groups]))
    finally:  # also runs when the client disconnects (the generator is closed at a yield or await)
        for task in tasks:
            task.cancel()
        _cancel_all(state, [g.handle for g in groups], "cancelled")


async def _collect_group(state: RouterState, group: _Group) -> list[ChoiceResult]:
    parts: dict[int, list[Piece]] = {id(c): [] for c in group.choices}
    while not group.is_finished:
        choice, piece = await _next_piece(state, group)
        parts[id(choice)].append(piece)
    return group.best([choice.result(parts[id(choice)]) for choice in group.choices])


async def _collect(state: RouterState, groups: list[_Group], shape: ResponseShape) -> dict:
    tasks = [asyncio.ensure_future(_collect_group(state, group)) for group in groups]
    try:
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return shape.full([r for group_results in results for r in group_results],
                      total_usage([g.usage() for g in groups]))


async def _wait_for_disconnect(http_request: Request) -> None:
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(http_request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first: then ``work`` is cancelled and ``ClientGone`` raised.

    A plain (non-streaming) handler is not cancelled when its client leaves, so it must watch for that.
    """
    task = asyncio.ensure_future(work)
    task.add_done_callback(_mark_retrieved)  # a failure after the client left (or after the first one) is expected
    watch = asyncio.ensure_future(_wait_for_disconnect(http_request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watch):
            if not pending.done():
                pending.cancel()  # finishes on the loop's next turn; nothing awaits it
    if not task.done() or task.cancelled():
        raise ClientGone
    return task.result()


def _mark_retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def collect(state: RouterState, http_request: Request, admitted: Admitted) -> dict | None:
    """The whole response body (None: the client left first); errors raise APIError."""
    try:
        return await unless_disconnected(http_request, _collect(state, admitted.groups, admitted.shape))
    except ClientGone:
        return None
    finally:
        _cancel_all(state, [g.handle for g in admitted.groups], "cancelled")
