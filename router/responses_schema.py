"""Pydantic body of POST /v1/responses (OpenAI's Responses API), and its translation into the chat request
the router already serves.

Stateless: nothing is stored, so ``previous_response_id`` and ``store: true`` are 400s (send the
conversation as ``input`` items, as the SDK's ``input=[..., *response.output, ...]`` does). Unknown
fields are 400s too. Input items: messages (text parts), earlier ``function_call`` items and their
``function_call_output``, and ``reasoning`` items (their text goes back to the template as the next
assistant turn's ``reasoning_content``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, StrictBool, StrictInt, Tag

from router.errors import bad_request
from router.openai_schema import Int64, RequestBody


class InputText(RequestBody):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # output_text sent back: citations (none here)
    logprobs: list[Any] | None = None


class MessageItem(RequestBody):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(RequestBody):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(RequestBody):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]  # a list: the tool's content parts (text only: no images or files here)
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(RequestBody):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(RequestBody):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    status: str | None = None

    def text(self) -> str:
        return "".join(p.text for p in (self.content or self.summary))


def _item_type(value: Any) -> str | None:
    """Which item ``value`` is (a message may leave out its type), so a bad one is told what is wrong with it as
    that item; tags read "item:<type>" (router/errors.py leaves them out of the field path it reports)."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return f"item:{kind}"


InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("item:message")], Annotated[FunctionCallItem, Tag("item:function_call")],
          Annotated[FunctionCallOutputItem, Tag("item:function_call_output")],
          Annotated[ReasoningItem, Tag("item:reasoning")]],
    Discriminator(_item_type, custom_error_type="invalid_item",
                  custom_error_message="an input item's type must be message, function_call, function_call_output "
                                       "or reasoning")]


class FunctionTool(RequestBody):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunctionChoice(RequestBody):
    type: Literal["function"]
    name: str


class TextFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: StrictBool | None = None


class TextOptions(RequestBody):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only level a model without that training has


class ResponsesRequest(RequestBody):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunctionChoice] | None = None
    parallel_tool_calls: StrictBool = True
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: StrictBool = False
    text: TextOptions | None = None
    store: StrictBool | None = None  # stateless: true is a 400 (below)
    previous_response_id: str | None = None  # stateless: a 400 (below) that says to send the conversation
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None  # echoed back in the response object, as OpenAI does
    # vLLM-style extras, as on the chat endpoint (vllm bench serve sends ignore_eos on every request)
    seed: Int64 | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool | None = None
    min_tokens: StrictInt | None = None
    priority: Int64 = 0  # vLLM's: lower is served first
    chat_template_kwargs: dict[str, Any] | None = None


def chat_body(body: ResponsesRequest) -> dict[str, Any]:
    """The equivalent /v1/chat/completions body (validated by the caller as a ChatCompletionRequest)."""
    if body.store:
        raise bad_request("store: this server keeps no responses; send store false or leave it out", param="store")
    if body.previous_response_id is not None:
        raise bad_request("previous_response_id: this server keeps no responses; send the conversation as input "
                          "items (the earlier output items included)", param="previous_response_id")
    if body.include:
        raise bad_request(f"include: not supported ({', '.join(body.include)})", param="include")
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    pending_reasoning: str | None = None
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in items:
        if isinstance(item, ReasoningItem):
            pending_reasoning = (pending_reasoning or "") + item.text()
        elif isinstance(item, MessageItem):
            message: dict[str, Any] = {"role": item.role, "content": item.text()}
            if item.role == "assistant" and pending_reasoning:
                message["reasoning_content"], pending_reasoning = pending_reasoning, None
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # one turn: its text, then its calls
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if pending_reasoning:
                    message["reasoning_content"], pending_reasoning = pending_reasoning, None
                messages.append(message)
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    if not messages:
        raise bad_request("input: must hold at least one message", param="input")
    # streamed on the chat side either way: a whole response is the stream's last event, so both forms hold the
    # same items in the order the model wrote them
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": True,
                            "stream_options": {"include_usage": True},
                            "parallel_tool_calls": body.parallel_tool_calls}
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "stop", "stop_token_ids",
                 "ignore_eos", "min_tokens", "chat_template_kwargs", "user", "priority"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in body.tools]
    if body.tool_choice is not None:
        choice = body.tool_choice
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    text_format = body.text.format if body.text else None
    if text_format is not None and text_format.type != "text":
        if text_format.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        else:
            if text_format.schema_ is None:
                raise bad_request("text.format: json_schema needs a schema", param="text.format")
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": text_format.name or "answer", "schema": text_format.schema_}}
    return chat

