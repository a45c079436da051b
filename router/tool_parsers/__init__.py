"""Tool calls out of a model's generated text, one parser per model family, chosen by name as in vLLM
(``--tool-call-parser hermes``): whole texts (``extract``), streams (``streaming``), and the grammar that
forces a call (``call_grammar``, for ``tool_choice`` "required" or a named tool)."""

from __future__ import annotations

from router.tool_parsers.base import StreamingToolParser, ToolCall, ToolCallDelta, ToolParser, new_call_id
from router.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from router.tool_parsers.harmony import HarmonyToolParser
from router.tool_parsers.hermes import HermesToolParser
from router.tool_parsers.llama3_json import Llama3JsonToolParser
from router.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, HarmonyToolParser,
                                       DeepSeekV3ToolParser, DeepSeekV31ToolParser)
}

__all__ = ["TOOL_PARSERS", "StreamingToolParser", "ToolCall", "ToolCallDelta", "ToolParser", "get_tool_parser",
           "infer_tool_parser", "new_call_id"]


def get_tool_parser(name: str) -> ToolParser:
    """The parser called ``name``; ValueError naming the known ones otherwise."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r} (known: {', '.join(sorted(TOOL_PARSERS))})")
    return TOOL_PARSERS[name]()


def infer_tool_parser(chat_template: str | None) -> str | None:
    """The parser a chat template implies, when exactly one format's marks are in it; None otherwise."""
    if not chat_template:
        return None
    found = set()
    if "<tool_call>" in chat_template:
        found.add("hermes")
    if "[TOOL_CALLS]" in chat_template:
        found.add("mistral")
    if "<|python_tag|>" in chat_template or ('"parameters"' in chat_template and "ipython" in chat_template):
        found.add("llama3_json")
    if "<|call|>" in chat_template and "<|channel|>" in chat_template:
        found.add("harmony")
    if "<｜tool▁calls▁begin｜>" in chat_template:  # V3's template fences the arguments as a json block, V3.1's not
        found.add("deepseek_v3" if "```json" in chat_template else "deepseek_v31")
    return found.pop() if len(found) == 1 else None
