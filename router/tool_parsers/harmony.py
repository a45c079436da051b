"""gpt-oss's harmony tool calls: a message addressed to ``functions.NAME`` whose body is the arguments' JSON,
``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`` (the recipient may also
sit before the channel, after ``<|start|>assistant``).

It reads raw harmony text (every other message's body is content, analysis included, as with no reasoning
parser) and the ``gpt_oss`` reasoning parser's content (text with calls passed on as canonical messages)
alike; the scanning is ``router.harmony``'s. The markers are special tokens (``needs_special_tokens``). No
grammar forces a call in this format yet: ``tool_choice`` required or named is refused for it.
"""

from __future__ import annotations

from router import harmony
from router.errors import bad_request
from router.tool_parsers.base import Scan, ToolCall, ToolParser


class HarmonyToolParser(ToolParser):
    name = "harmony"
    needs_special_tokens = True
    initial_state = None

    def scan(self, text: str, state: harmony.OpenBody | None, final: bool) -> Scan:
        result = harmony.scan(text, state, final)
        content: list[str] = []
        calls: list[ToolCall] = []
        for piece in result.pieces:
            if isinstance(piece, harmony.Call):
                calls.append(ToolCall(name=piece.name, arguments=piece.arguments))
            else:
                content.append(piece if isinstance(piece, str) else piece.text)
        return Scan("".join(content), calls, result.consumed, result.state)

    def call_grammar(self, tools: list[dict], parallel: bool, tokenizer) -> str:
        raise bad_request("tool_choice: required or a named function is not supported for the harmony format yet "
                          "(its markers are special tokens); send tool_choice auto", param="tool_choice")
