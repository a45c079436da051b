"""DeepSeek-V3 tool calls: one block ``<｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>`` of calls, each
``<｜tool▁call▁begin｜> ... <｜tool▁call▁end｜>``, in either of DeepSeek's two layouts:

- V3 / V3-0324 / R1 (``deepseek_v3``): ``function<｜tool▁sep｜>NAME`` then the arguments as a fenced JSON block,
  ``\\n```json\\n{...}\\n```\\n``; the template puts a newline between calls;
- V3.1 and later (``deepseek_v31``): ``NAME<｜tool▁sep｜>{...}``.

The markers are special tokens of DeepSeek's tokenizer (detokenize keeping them). Both parsers read either layout
(a checkpoint's template decides which it writes; reading is lenient); they differ in the layout their grammar
forces. Text before the block is content; a block whose calls are complete but whose end marker never came (the
text ended, or something else followed) still gives its calls, as vLLM's and SGLang's DeepSeek parsers do.
"""

from __future__ import annotations

import re
from typing import ClassVar

from router.tool_parsers.base import (NEED_MORE, MarkedToolParser, ToolCall, Undecided, inline_json, json_extent,
                                      json_members, lark_string, marker_symbol, partial_marker_length, skip_space,
                                      tool_names_and_parameters)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"
_NAME = re.compile(r"[\w.\-]+")


def _expect(text: str, index: int, literal: str, final: bool) -> int | Undecided | None:
    """The index after ``literal`` at ``text[index:]``; ``NEED_MORE`` when the text ends inside a start of it (not
    ``final``); None when it is not there."""
    if text.startswith(literal, index):
        return index + len(literal)
    rest = len(text) - index
    if not final and rest < len(literal) and partial_marker_length(text, index, literal) == rest:
        return NEED_MORE
    return None


def _json_object(text: str, index: int, final: bool) -> tuple[int, int] | Undecided | None:
    """(start, end) of the strict JSON object at ``text[index:]`` after whitespace."""
    start = skip_space(text, index)
    if start == len(text):
        return None if final else NEED_MORE
    if text[start] != "{":
        return None
    end = json_extent(text, start)
    if end is None:
        return None if final else NEED_MORE
    return (start, end) if json_members(text, start, end) is not None else None


def _parse_call(text: str, index: int, final: bool) -> tuple[ToolCall, int] | Undecided | None:
    """One ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`` at ``index`` (its begin marker already matched there)."""
    sep = text.find(SEP, index)
    if sep < 0:  # more text may bring it, if what is here could still be a name or a type (and a start of it)
        head = text[index:len(text) - partial_marker_length(text, index, SEP)].strip()
        return None if final or (head and _NAME.fullmatch(head) is None) else NEED_MORE
    head = text[index:sep].strip()
    if _NAME.fullmatch(head) is None:
        return None
    after_sep = sep + len(SEP)
    if head == "function":  # V3: the type, then the name on the rest of the line and a fenced JSON block
        line_end = text.find("\n", after_sep)
        if line_end < 0:
            return None if final or _NAME.fullmatch(text[after_sep:].strip() or "x") is None else NEED_MORE
        name = text[after_sep:line_end].strip()
        if _NAME.fullmatch(name) is None:
            return None
        fence = _expect(text, skip_space(text, line_end), FENCE_OPEN, final)
        if not isinstance(fence, int):
            return fence
        body = _json_object(text, fence, final)
        if not isinstance(body, tuple):
            return body
        close = _expect(text, skip_space(text, body[1]), FENCE_CLOSE, final)
        if not isinstance(close, int):
            return close
        end = _expect(text, skip_space(text, close), CALL_END, final)
    else:  # V3.1: the name, then the JSON object
        name = head
        body = _json_object(text, after_sep, final)
        if not isinstance(body, tuple):
            return body
        end = _expect(text, skip_space(text, body[1]), CALL_END, final)
    if not isinstance(end, int):
        return end
    return ToolCall(name=name, arguments=text[body[0]:body[1]]), end


class DeepSeekV3ToolParser(MarkedToolParser):
    name = "deepseek_v3"
    needs_special_tokens = True
    marker = CALLS_BEGIN
    fenced: ClassVar[bool] = True  # the layout the grammar forces: V3's fenced JSON, or V3.1's bare object

    def parse_block(self, text: str, start: int, final: bool) -> tuple[list[ToolCall], int] | Undecided | None:
        calls: list[ToolCall] = []
        index = start
        while True:
            at = skip_space(text, index)
            if at == len(text) and not final:
                return NEED_MORE
            begin = _expect(text, at, CALL_BEGIN, final)
            if begin is NEED_MORE:
                return NEED_MORE
            if begin is None:
                end = _expect(text, at, CALLS_END, final)
                if end is NEED_MORE:
                    return NEED_MORE
                if not calls:
                    return None
                return calls, (end if end is not None else index)  # calls whole, the end marker missing
            call = _parse_call(text, begin, final)
            if call is NEED_MORE:
                return NEED_MORE
            if call is None:
                return (calls, index) if calls else None
            calls.append(call[0])
            index = call[1]

    def call_grammar(self, tools: list[dict], parallel: bool, tokenizer) -> str:
        """The whole block in this parser's layout, each call's arguments held to its tool's schema; the markers
        by token id where they are special tokens."""
        calls_begin, calls_end = marker_symbol(tokenizer, CALLS_BEGIN), marker_symbol(tokenizer, CALLS_END)
        call_begin, call_end, sep = (marker_symbol(tokenizer, marker) for marker in (CALL_BEGIN, CALL_END, SEP))
        tool_rules = []
        for number, (name, parameters) in enumerate(tool_names_and_parameters(tools)):
            if self.fenced:
                body = (f'"function" {sep} {lark_string(name)} {lark_string(chr(10) + FENCE_OPEN + chr(10))} '
                        f"{inline_json(parameters)} {lark_string(chr(10) + FENCE_CLOSE)}")
            else:
                body = f"{lark_string(name)} {sep} {inline_json(parameters)}"
            tool_rules.append(f"tc_tool{number}: {body}\n")
        alternatives = " | ".join(f"tc_tool{number}" for number in range(len(tool_rules)))
        separator = '"\\n" ' if self.fenced else ""
        calls = f"tc_call ({separator}tc_call)*" if parallel else "tc_call"
        return (f"tool_calls: {calls_begin} {calls} {calls_end}\n"
                f"tc_call: {call_begin} ({alternatives}) {call_end}\n" + "".join(tool_rules))


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    name = "deepseek_v31"
    fenced = False
