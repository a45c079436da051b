"""A chat request's messages and tools in the form chat templates read (transformers' conventions).

The OpenAI wire carries a tool call's arguments as JSON text; templates (Qwen's, Llama's, Mistral's)
write them with ``tojson``, so they get the parsed object, as transformers' own examples pass it and
as vLLM does. Text is checked for lone surrogates here, once for every string that reaches the tokenizer.

A message whose content is a list of text parts reaches a template that walks a message's content itself
(Llama 3's, Gemma 3's: ``{% for part in message['content'] %}``) as that list, and any other template as
the parts' texts joined by newlines: vLLM's two content formats ("openai" and "string"), told apart as
vLLM does, by whether the template loops over a message's content.
"""

from __future__ import annotations

import json
import re
from typing import Any

# a loop over a message's content in a chat template: ``for x in message['content']`` / ``message.content``
_LOOPS_OVER_CONTENT = re.compile(r"\bfor\s+\w+\s+in\s+\w+(?:\[\s*['\"]content['\"]\s*\]|\.content\b)")

from router.errors import bad_request
from router.openai_schema import ChatMessage, ChatTool


def check_text(text: str, param: str) -> None:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{param}: not valid Unicode text (a lone surrogate at position {exc.start})",
                          param=param) from None


def walks_content_parts(template: str | None) -> bool:
    """Whether ``template`` reads a message's content parts itself (vLLM's "openai" content format)."""
    return bool(template) and _LOOPS_OVER_CONTENT.search(template) is not None


def template_messages(messages: list[ChatMessage], content_parts: bool = False) -> list[dict[str, Any]]:
    """The messages for a template; ``content_parts``: the template walks a list content's parts itself."""
    out = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message.text()}
        check_text(item["content"], "messages")
        if content_parts and isinstance(message.content, list):
            item["content"] = [{"type": "text", "text": part.text} for part in message.content]
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls:
            if message.role != "assistant":
                raise bad_request("messages: only assistant messages carry tool_calls", param="messages")
            item["tool_calls"] = [{"id": call.id, "type": "function",
                                   "function": {"name": call.function.name,
                                                "arguments": _arguments(call.function.arguments)}}
                                  for call in message.tool_calls]
        if message.role == "tool":
            if message.tool_call_id is None:
                raise bad_request("messages: a tool message needs the tool_call_id it answers", param="messages")
            item["tool_call_id"] = message.tool_call_id
        if message.reasoning_content:
            item["reasoning_content"] = message.reasoning_content
        out.append(item)
    return out


def _arguments(text: str) -> Any:
    check_text(text, "messages")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text  # a malformed earlier call is shown as the model wrote it
    return value if isinstance(value, dict) else text


def template_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """The tools as ``{"type": "function", "function": {name, description, parameters}}``, unset keys left out."""
    if not tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in tools]
