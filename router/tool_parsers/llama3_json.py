"""Llama 3.1/3.2 JSON tool calls: the whole output is ``{"name": ..., "parameters": {...}}`` (or
``"arguments"``), optionally after ``<|python_tag|>``, several joined by ``;``.

Only an output whose first non-whitespace text is ``{`` or ``<|python_tag|>`` can be calls; any other is
all content. The calls are the longest run of well-formed call objects from there; what follows the last
one (its leading whitespace dropped) is content. An output with no well-formed call is content, as written.
"""

from __future__ import annotations

from enum import Enum

from router.tool_parsers.base import (Scan, ToolCall, ToolParser, any_call_schema, call_from_members,
                                      inline_json, json_extent, json_members, lark_string, skip_space)

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")
SEPARATOR = "; "  # how Llama 3.2 joins parallel calls


class Position(Enum):
    """Where a scan starts: before any call (the start of the output), after a call, or in content to the end."""

    START = "start"
    AFTER_CALL = "after_call"
    CONTENT = "content"


_UNDECIDED, _NOT_A_CALL = object(), object()


def _call_at(text: str, start: int, final: bool) -> tuple[ToolCall, int] | object:
    """The call object opening at ``text[start]`` and its end, ``_UNDECIDED`` or ``_NOT_A_CALL``."""
    if start == len(text):
        return _NOT_A_CALL if final else _UNDECIDED
    if text[start] != "{":
        return _NOT_A_CALL
    end = json_extent(text, start)
    if end is None:
        return _NOT_A_CALL if final else _UNDECIDED
    call = call_from_members(text, json_members(text, start, end), ARGUMENT_KEYS)
    return _NOT_A_CALL if call is None else (call, end)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    initial_state = Position.START

    def scan(self, text: str, state: Position, final: bool) -> Scan:
        if state is Position.CONTENT:
            return Scan(text, [], len(text), state)
        calls: list[ToolCall] = []
        if state is Position.START:
            first = skip_space(text, 0)
            rest = text[first:]
            if not final and (first == len(text) or (PYTHON_TAG.startswith(rest) and rest != PYTHON_TAG)):
                return Scan("", [], 0, state)  # all whitespace so far, or maybe the tag
            if rest.startswith(PYTHON_TAG):
                first = skip_space(text, first + len(PYTHON_TAG))
            found = _call_at(text, first, final)
            if found is _UNDECIDED:
                return Scan("", [], 0, state)
            if found is _NOT_A_CALL:
                return Scan(text, [], len(text), Position.CONTENT)
            call, index = found
            calls.append(call)
        else:
            index = 0
        while True:  # after a call: whitespace is dropped, then "; {call}" or the content to the end
            index = skip_space(text, index)
            if index == len(text):
                return Scan("", calls, index, Position.AFTER_CALL)
            found = _NOT_A_CALL
            if text[index] == ";":
                found = _call_at(text, skip_space(text, index + 1), final)
            if found is _UNDECIDED:
                return Scan("", calls, index, Position.AFTER_CALL)
            if found is _NOT_A_CALL:
                return Scan(text[index:], calls, len(text), Position.CONTENT)
            call, index = found
            calls.append(call)

    def call_grammar(self, tools: list[dict], parallel: bool, tokenizer) -> str:
        """The bare JSON objects (no ``<|python_tag|>``, as Llama writes JSON calls), joined by "; "."""
        calls = f"tc_call ({lark_string(SEPARATOR)} tc_call)*" if parallel else "tc_call"
        return f"tool_calls: {calls}\ntc_call: {inline_json(any_call_schema(tools, 'parameters'))}\n"
