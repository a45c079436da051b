"""A chat answer's text -> OpenAI's message fields: ``reasoning_content``, ``content``, ``tool_calls``.

The reasoning parser splits the thinking off first; what follows goes through the tool-call parser.
Whole answers and streams give the same fields: ``ChatOutputStream`` feeds the same parsers piece by
piece (they hold back only what may still turn out to be a marker) and its deltas add up to
``ChatOutputFormat.message`` of the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.reasoning import ReasoningParser
from router.tool_parsers import ToolCall, ToolCallDelta, ToolParser


@dataclass
class ChatOutputFormat:
    tool_parser: ToolParser | None = None  # None: no calls are read (no tools, or tool_choice none)
    reasoning: ReasoningParser | None = None
    starts_inside_thinking: bool = False  # the prompt ends in an open <think> (the answer starts inside it)
    include_reasoning: bool = True
    named_call: bool = False  # tool_choice named a function: OpenAI answers finish_reason "stop"

    @property
    def is_plain(self) -> bool:
        return self.tool_parser is None and self.reasoning is None

    def message(self, text: str) -> dict[str, Any]:
        """The message's fields for a whole answer (role excluded)."""
        fields: dict[str, Any] = {}
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract(text, self.starts_inside_thinking)
            fields["reasoning_content"] = reasoning if self.include_reasoning else None
        calls: list[ToolCall] = []
        if self.tool_parser is not None:
            content, calls = self.tool_parser.extract(content)
        # null when tool calls or the thinking are all there is (vLLM's reasoning parsers give None there too)
        fields["content"] = content if content or not (calls or self.reasoning is not None) else None
        if calls:
            fields["tool_calls"] = [call_json(call) for call in calls]
        return fields

    def finish_reason(self, reason: str | None, made_calls: bool) -> str | None:
        if reason == "stop" and made_calls and not self.named_call:
            return "tool_calls"
        return reason

    def streaming(self) -> "ChatOutputStream":
        return ChatOutputStream(self)


def call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def call_delta_json(delta: ToolCallDelta) -> dict[str, Any]:
    """OpenAI's ``delta.tool_calls[i]``: id, type and name on a call's first delta, then arguments pieces."""
    item: dict[str, Any] = {"index": delta.index}
    if delta.id is not None:
        item["id"] = delta.id
        item["type"] = "function"
    function: dict[str, Any] = {"arguments": delta.arguments}
    if delta.name is not None:
        function["name"] = delta.name
    item["function"] = function
    return item


class ChatOutputStream:
    """One choice's stream: text pieces in, delta fields out."""

    def __init__(self, fmt: ChatOutputFormat) -> None:
        self._format = fmt
        self._reasoning = fmt.reasoning.streaming(fmt.starts_inside_thinking) if fmt.reasoning else None
        self._tools = fmt.tool_parser.streaming() if fmt.tool_parser else None
        self.made_calls = False

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        """Delta fields for ``text`` (all of it released when ``final``); only non-empty fields."""
        reasoning, content = "", text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text)
            if final:
                more_reasoning, more_content = self._reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        deltas: list[ToolCallDelta] = []
        if self._tools is not None:
            content, deltas = self._tools.feed(content)
            if final:
                more_content, more_deltas = self._tools.finish()
                content, deltas = content + more_content, deltas + more_deltas
        fields: dict[str, Any] = {}
        if reasoning and self._format.include_reasoning:
            fields["reasoning_content"] = reasoning
        if content:
            fields["content"] = content
        if deltas:
            self.made_calls = True
            fields["tool_calls"] = [call_delta_json(d) for d in deltas]
        return fields
