"""POST /v1/responses: OpenAI's Responses API over the chat path.

A request becomes the equivalent chat request (``router.responses_schema``), is prepared, admitted and
served exactly as one (same tool plan, reasoning, constraints, 429s), and its answer is reshaped:
output items ``reasoning`` / ``message`` (``output_text``) / ``function_call`` in the order the model
wrote them, usage as ``input_tokens`` / ``output_tokens``, ``status`` ``incomplete`` when the answer
hit its token limit. Streaming sends OpenAI's typed events (``response.created`` ...
``response.completed``, each with a ``sequence_number``), which the SDK's ``responses.stream``
accumulates unchanged.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pipeline.protocol import SamplingParams
from router.errors import APIError, bad_request
from router.openai_schema import ChatCompletionRequest
from router.preprocess import PreparedRequest, renamed
from router.responses_schema import ResponsesRequest, chat_body
from router.sse import sse_event
from router.served_model import ServedModel
from router.serving import ClientGone, RouterState, admit, chunks, event_stream, unless_disconnected


def install_responses_route(app: FastAPI, state: RouterState,
                            prepare: Callable[[ChatCompletionRequest], Awaitable[list[PreparedRequest]]]) -> None:
    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        try:
            chat = ChatCompletionRequest.model_validate(chat_body(body))
        except ValidationError as exc:  # an input item the chat path refuses: say which
            error = exc.errors()[0]
            where = ".".join(str(p) for p in error.get("loc", ()))
            raise bad_request(f"input: {where}: {error.get('msg')}", param="input") from None
        try:
            prepared = await prepare(chat)
        except APIError as exc:  # named as this request names the field
            raise renamed(exc, _CHAT_TO_RESPONSES_FIELDS) from None
        response_id = f"resp_{uuid.uuid4().hex}"
        shell = _ResponseShell(response_id, state.model, body, prepared[0].params)
        admitted = await admit(state, request, prepared, "chat", request_id=response_id)
        if admitted is None:
            return Response(status_code=499)  # the client left while waiting
        if body.stream:
            return event_stream(_sse(_events(shell, chunks(state, admitted))))
        try:  # the whole response: the stream's last event, read here (a failure raised as the error it is)
            events = _events(shell, chunks(state, admitted), raise_errors=True)
            final = await unless_disconnected(request, _final_event(events))
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(final["response"])


# the chat request's fields a Responses request sets under other names (router/responses_schema.chat_body)
_CHAT_TO_RESPONSES_FIELDS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                             "messages": "input"}


class _ResponseShell:
    """What every form of one response shares: id, model, the request's settings echoed back."""

    def __init__(self, response_id: str, model: ServedModel, body: ResponsesRequest, params: SamplingParams) -> None:
        """``params``: what the request runs with (the defaults it left unset filled in), echoed back."""
        self.id = response_id
        self.model = model.name
        self.tokenizer = model.tokenizer
        self.body = body
        self.params = params
        self.created_at = int(time.time())

    def response(self, output: list[dict[str, Any]], finish_reason: str | None, usage: dict[str, Any] | None,
                 status: str | None = None) -> dict[str, Any]:
        body = self.body
        incomplete = finish_reason == "length"
        status = status or ("incomplete" if incomplete else "completed")
        text_format = (body.text.format.model_dump(by_alias=True, exclude_none=True)
                       if body.text and body.text.format else {"type": "text"})
        tool_choice = body.tool_choice if body.tool_choice is None or isinstance(body.tool_choice, str) \
            else body.tool_choice.model_dump()
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": status, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete and status == "incomplete" else None,
            "instructions": body.instructions, "metadata": body.metadata or {},
            "max_output_tokens": body.max_output_tokens, "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": None, "store": False, "temperature": self.params.temperature, "top_p": self.params.top_p,
            "text": {"format": text_format}, "tool_choice": tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()], "truncation": "disabled",
            "usage": self._usage(usage, output) if usage is not None else None,
        }

    def _usage(self, usage: dict[str, Any], output: list[dict[str, Any]]) -> dict[str, Any]:
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(output, usage)},
                "total_tokens": usage["total_tokens"]}

    def _reasoning_tokens(self, output: list[dict[str, Any]], usage: dict[str, Any]) -> int:
        """The output's reasoning items counted in tokens: their text tokenized again (the parser splits text,
        not tokens; the tags between reasoning and answer are not counted), at most every output token."""
        texts = [part["text"] for item in output if item["type"] == "reasoning" for part in item["content"]]
        count = sum(len(self.tokenizer.encode(text, add_special_tokens=False)) for text in texts if text)
        return min(count, usage["completion_tokens"])


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _OutputItems:
    """Output items built from chat deltas in the order they arrive.

    Every change of kind (thinking, text, a call) opens a new item; ``events`` gathers the typed events
    a stream sends for that (``sequence_number`` is filled by the caller)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item deltas currently extend
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item

    def add_delta(self, delta: dict[str, Any]) -> None:
        if delta.get("reasoning_content"):
            self._extend("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            self._extend("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            self._call_delta(call)

    def close(self, status: str = "completed") -> None:
        """Finish the open item (its done events): ``completed``, or ``incomplete`` when the answer was cut short."""
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = status
        index = self.items.index(item)
        if item["type"] == "message":
            part = item["content"][0]
            self.events += [
                {"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                 "content_index": 0, "text": part["text"], "logprobs": []},
                {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                 "content_index": 0, "part": dict(part)}]
        elif item["type"] == "reasoning":
            self.events.append({"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": index,
                                "content_index": 0, "text": item["content"][0]["text"]})
        else:
            self.events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                                "output_index": index, "name": item["name"], "arguments": item["arguments"]})
        self.events.append({"type": "response.output_item.done", "output_index": index, "item": _copy(item)})

    def _start(self, item: dict[str, Any]) -> int:
        self.close()
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        added = _copy(item)
        if item["type"] == "message":
            added["content"] = []
        self.events.append({"type": "response.output_item.added", "output_index": index, "item": added})
        if item["type"] == "message":
            self.events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                                "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [],
                                                             "logprobs": []}})
        return index

    def _extend(self, kind: str, text: str) -> None:
        item = self._open
        if item is None or item["type"] != kind:
            if kind == "message":
                item = {"type": "message", "id": _item_id("msg"), "status": "in_progress", "role": "assistant",
                        "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
            else:
                item = {"type": "reasoning", "id": _item_id("rs"), "status": "in_progress", "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}]}
            self._start(item)
        index = self.items.index(item)
        item["content"][0]["text"] += text
        event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        self.events.append({"type": event, "item_id": item["id"], "output_index": index, "content_index": 0,
                            "delta": text, **extra})

    def _call_delta(self, delta: dict[str, Any]) -> None:
        function = delta.get("function") or {}
        item = self._calls.get(delta["index"])
        if item is None:
            item = {"type": "function_call", "id": _item_id("fc"), "call_id": delta.get("id") or _item_id("call"),
                    "name": function.get("name", ""), "arguments": "", "status": "in_progress"}
            self._calls[delta["index"]] = item
            self._start(item)
        pieces = function.get("arguments") or ""
        if pieces:
            item["arguments"] += pieces
            self.events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                                "output_index": self.items.index(item), "delta": pieces})


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    copied = dict(item)
    if "content" in copied:
        copied["content"] = [dict(part) for part in copied["content"]]
    return copied


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(events):  # a client that leaves closes this, which must close the events too
        async for payload in events:
            yield sse_event(payload, event=payload["type"])


async def _final_event(events: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    last: dict[str, Any] = {}
    async with contextlib.aclosing(events):
        async for payload in events:
            last = payload
    return last


async def _events(shell: _ResponseShell, chat_chunks: AsyncIterator[dict | APIError], raise_errors: bool = False
                  ) -> AsyncIterator[dict[str, Any]]:
    """Chat chunks -> Responses events, ending with ``response.completed`` / ``incomplete`` or ``response.failed``
    (``raise_errors``: the failure raised instead, for a whole response)."""
    sequence = 0

    def event(payload: dict[str, Any]) -> dict[str, Any]:
        nonlocal sequence
        payload["sequence_number"] = sequence
        sequence += 1
        return payload

    writer = _OutputItems()
    finish_reason, usage = None, None
    yield event({"type": "response.created", "response": shell.response([], None, None, status="in_progress")})
    yield event({"type": "response.in_progress", "response": shell.response([], None, None, status="in_progress")})
    async with contextlib.aclosing(chat_chunks):
        async for chunk in chat_chunks:
            if isinstance(chunk, APIError):
                if raise_errors:
                    raise chunk
                writer.close()
                for pending in writer.events:
                    yield event(pending)
                failed = shell.response(writer.items, None, None, status="failed")
                failed["error"] = {"code": "server_error" if chunk.status_code >= 500 else str(chunk.code or "error"),
                                   "message": chunk.message}
                yield event({"type": "response.failed", "response": failed})
                return
            if chunk.get("usage") and not chunk["choices"]:
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                writer.add_delta(choice["delta"])
                finish_reason = choice.get("finish_reason") or finish_reason
            for pending in writer.events:
                yield event(pending)
            writer.events.clear()
    writer.close("incomplete" if finish_reason == "length" else "completed")  # the last item is what was cut
    for pending in writer.events:
        yield event(pending)
    final = shell.response(writer.items, finish_reason, usage)
    yield event({"type": "response.incomplete" if final["status"] == "incomplete" else "response.completed",
                 "response": final})
