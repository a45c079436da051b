"""Hermes-style tool calls (Hermes 2 Pro, Qwen2.5, Qwen3):
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, once per call.

``<tool_call>`` and ``</tool_call>`` are plain text once detokenized (Qwen's added tokens are not special).
A block runs from ``<tool_call>`` to the first ``</tool_call>`` after it, as vLLM reads it; a block never
closed is a call only if the text ends with its complete JSON (generation stopped on the closing tag).
The members may come in either order (Hermes 2 Pro writes ``arguments`` first, Qwen ``name`` first).
"""

from __future__ import annotations

from router.tool_parsers.base import (NEED_MORE, MarkedToolParser, ToolCall, Undecided, any_call_schema,
                                      call_from_members, end_of_text_before_space, inline_json, json_members,
                                      lark_string, skip_space)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(MarkedToolParser):
    name = "hermes"
    marker = START

    def parse_block(self, text: str, start: int, final: bool) -> tuple[list[ToolCall], int] | Undecided | None:
        close = text.find(END, start)
        body_start = skip_space(text, start)
        if body_start < len(text) and text[body_start] != "{":
            return None  # decided now: a tag named in prose is not held back to its end
        if close < 0 and not final:
            return NEED_MORE
        body_end = len(text) if close < 0 else close
        body_end = end_of_text_before_space(text, body_start, body_end)
        members = json_members(text, body_start, body_end)
        call = call_from_members(text, members, ("arguments",))
        if call is None:
            return None
        return [call], len(text) if close < 0 else close + len(END)

    def call_grammar(self, tools: list[dict], parallel: bool, tokenizer) -> str:
        """Qwen's layout: each call on its own lines between the tags, calls one per line."""
        calls = 'tc_call ("\\n" tc_call)*' if parallel else "tc_call"
        return (f"tool_calls: {calls}\n"
                f"tc_call: {lark_string(START + chr(10))} tc_body {lark_string(chr(10) + END)}\n"
                f"tc_body: {inline_json(any_call_schema(tools, 'arguments'))}\n")

    def text_or_calls_grammar(self, tools: list[dict], parallel: bool, tokenizer) -> str | None:
        """Any text without the opening tag, or text up to the first tag (a lazy lexeme: llguidance's pattern
        for tool calls written in text) and then the calls: once the model writes the tag, the call must
        parse and follow its tool's schema (OpenAI's strict tools under tool_choice auto)."""
        more = ' ("\\n" tc_call)*' if parallel else ""
        return (f"tc_text_or_calls: TC_TEXT | tc_head tc_first{more}\n"
                f"TC_TEXT: /(?s:.*)/ & ~/(?s:.*){START}(?s:.*)/\n"
                f"tc_head[lazy]: /(?s:.*){START}/\n"
                f"tc_first: {lark_string(chr(10))} tc_body {lark_string(chr(10) + END)}\n"
                + self.call_grammar(tools, parallel, tokenizer))
