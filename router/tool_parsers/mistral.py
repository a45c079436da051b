"""Mistral tool calls: ``[TOOL_CALLS]`` then a JSON array ``[{"name": ..., "arguments": {...}}, ...]``, or
(tokenizers v11 and later) ``[TOOL_CALLS]name[ARGS]{...}``, once per call.

``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens, so the text must be detokenized keeping them. Text
before the marker is content. An array block is a call block only when every element is a call. Ids are
9 letters and digits: Mistral's chat templates refuse any other id when the calls come back in history.
"""

from __future__ import annotations

import re
import secrets
import string

from router.tool_parsers.base import (NEED_MORE, MarkedToolParser, ToolCall, Undecided, any_call_schema,
                                      call_from_members, inline_json, json_extent, json_members, lark_string,
                                      marker_symbol, partial_marker_length, skip_json_space, skip_space,
                                      tool_names_and_parameters)

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[\w.\-]+")
_ID_ALPHABET = string.ascii_letters + string.digits


def new_mistral_call_id() -> str:
    """9 random letters and digits, the only ids Mistral's templates take back."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


class MistralToolParser(MarkedToolParser):
    name = "mistral"
    needs_special_tokens = True
    marker = MARKER

    def parse_block(self, text: str, start: int, final: bool) -> tuple[list[ToolCall], int] | Undecided | None:
        undecided = None if final else NEED_MORE
        index = skip_space(text, start)
        if index == len(text):
            return undecided
        if text[index] == "[":
            return _parse_array(text, index, undecided)
        name = _NAME.match(text, index)
        if name is None:
            return None
        args_start = name.end()
        rest = len(text) - args_start
        if rest == 0 or (rest < len(ARGS) and partial_marker_length(text, args_start, ARGS) == rest):
            return undecided  # the name, or the [ARGS] after it, may go on
        if not text.startswith(ARGS, args_start):
            return None
        object_start = skip_space(text, args_start + len(ARGS))
        if object_start == len(text):
            return undecided
        if text[object_start] != "{":
            return None
        object_end = json_extent(text, object_start)
        if object_end is None:
            return undecided
        if json_members(text, object_start, object_end) is None:
            return None
        call = ToolCall(name=name.group(), arguments=text[object_start:object_end], id=new_mistral_call_id())
        return [call], object_end

    def call_grammar(self, tools: list[dict], parallel: bool, tokenizer) -> str:
        """``[TOOL_CALLS]name[ARGS]{...}`` per call when the tokenizer knows ``[ARGS]`` (v11+), else
        ``[TOOL_CALLS][{...}, ...]``; a marker that is a special token is matched by its id."""
        calls_marker = marker_symbol(tokenizer, MARKER)
        if not _has_token(tokenizer, ARGS):
            calls = any_call_schema(tools, "arguments")
            array = {"type": "array", "items": calls, "minItems": 1}
            if "$defs" in calls:  # where the tools' $refs point: the root
                array["$defs"] = calls.pop("$defs")
            if not parallel:
                array["maxItems"] = 1
            return f"tool_calls: {calls_marker} tc_array\ntc_array: {inline_json(array)}\n"
        args_marker = marker_symbol(tokenizer, ARGS)
        tool_rules = [f"tc_tool{number}: {lark_string(name)} {args_marker} {inline_json(parameters)}\n"
                      for number, (name, parameters) in enumerate(tool_names_and_parameters(tools))]
        alternatives = " | ".join(f"tc_tool{number}" for number in range(len(tool_rules)))
        return (f"tool_calls: {'tc_call+' if parallel else 'tc_call'}\n"
                f"tc_call: {calls_marker} ({alternatives})\n" + "".join(tool_rules))


def _parse_array(text: str, start: int, undecided) -> tuple[list[ToolCall], int] | Undecided | None:
    end = json_extent(text, start)
    if end is None:
        return undecided
    calls = []
    for element_start, element_end in _array_elements(text, start, end):
        members = json_members(text, element_start, element_end)
        call = call_from_members(text, members, ("arguments",), id=new_mistral_call_id())
        if call is None:
            return None
        calls.append(call)
    return (calls, end) if calls else None


def _array_elements(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """(start, end) of each object in the JSON array ``text[start:end]``; [] when it is not an array of objects."""
    elements = []
    index = skip_json_space(text, start + 1)
    while index < end and text[index] == "{":
        element_end = json_extent(text, index)
        if element_end is None or element_end > end:
            return []
        elements.append((index, element_end))
        index = skip_json_space(text, element_end)
        if text[index] == "]" and index + 1 == end:
            return elements
        if text[index] != ",":
            return []
        index = skip_json_space(text, index + 1)
    return []


def _has_token(tokenizer, token: str) -> bool:
    if tokenizer is None:
        return False
    token_id = tokenizer.convert_tokens_to_ids(token)
    return token_id is not None and token_id != getattr(tokenizer, "unk_token_id", None)
