"""Thinking text out of ``<think>...</think>`` models (Qwen3, DeepSeek-R1), whole or streamed, and the
grammar prefix that lets a constrained answer follow the thinking.

Inside a block (the prompt opened it, or the output starts with ``<think>`` after whitespace),
everything up to the first ``</think>`` is reasoning and the rest is content; a block never closed
(generation stopped early) is all reasoning. Reasoning is stripped of whitespace at both ends, content
of whitespace at its start. An output that opens no block is all content, as written, reasoning None.

The tags are text, as Qwen3's and DeepSeek-R1's added tokens are not special. The streaming parser holds
back only a possible start of a tag and whitespace whose fate the next text decides.
"""

from __future__ import annotations

from enum import Enum
from typing import ClassVar, NamedTuple

from router.harmony import HarmonyReasoningParser


class Position(Enum):
    """Where a scan starts: before anything decided, at the start of the reasoning, in the reasoning, at
    the start of the content (whitespace to drop), or in the content."""

    BEFORE = "before"
    REASONING_START = "reasoning_start"
    REASONING = "reasoning"
    CONTENT_START = "content_start"
    CONTENT = "content"


class _Scan(NamedTuple):
    reasoning: str
    content: str
    consumed: int
    position: Position


def _partial_tag_length(text: str, tag: str) -> int:
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def _hex(char: str) -> str:
    return f"\\x{ord(char):02X}"


def _until_first(tag: str) -> str:
    """A regex of any text that ends with its first ``tag`` (a lazy ``(?s:.*?)tag`` that llguidance's
    regexes lack), built from the tag's matching automaton. It needs a tag whose first character does not
    come again in it: then any such character puts the automaton back at 1, any other miss at 0."""
    first, rest = tag[0], tag[1:]
    assert first not in rest, tag
    chars = [_hex(c) for c in tag]
    # text that leaves the automaton at 0: a non-first character, or first + (partial match + first)* + a miss
    partials = "".join(f"(?:{c}" for c in chars[1:-1]) + ")?" * (len(chars) - 2)  # a proper start of rest
    misses = []
    for k in range(1, len(tag)):
        misses.append("".join(chars[1:k]) + f"[^{chars[k]}{chars[0]}]")
    back_to_zero = f"{chars[0]}(?:{partials}{chars[0]})*(?:{'|'.join(misses)})"
    ends_partway = f"(?:{chars[0]}(?:{partials}{chars[0]})*{partials})?"
    return f"(?:[^{chars[0]}]|{back_to_zero})*{ends_partway}{''.join(chars)}"


class ReasoningParser:
    """The ``<think>...</think>`` format (stateless; ``get_reasoning_parser`` makes them)."""

    name: ClassVar[str] = "think"
    start: str = "<think>"
    end: str = "</think>"

    def starts_inside(self, prompt_text: str) -> bool:
        """The rendered prompt leaves a block open (its last start tag after its last end tag), as
        DeepSeek-R1's template and Qwen3's continuations do: the output begins as reasoning."""
        return prompt_text.rfind(self.start) > prompt_text.rfind(self.end)

    def extract(self, text: str, inside: bool) -> tuple[str | None, str]:
        """(reasoning, content) of a whole output; reasoning None when the output opens no block."""
        position = Position.REASONING_START if inside else Position.BEFORE
        result = self.scan(text, position, final=True)
        opened = inside or text.lstrip().startswith(self.start)
        return (result.reasoning if opened else None), result.content

    def streaming(self, inside: bool) -> "StreamingReasoningParser":
        """Fresh state for one choice's stream."""
        return StreamingReasoningParser(self, inside)

    def grammar_prefix(self, inside: bool) -> str:
        """A Lark sequence for ``start: <prefix> body``: any thinking then the end tag when ``inside``, an
        optional whole block otherwise, and at most four whitespace characters after it. One regex each, as a sequence cannot define
        a lazy rule: thinking cannot hold the end tag, so the block ends at the model's first one."""
        thinking = _until_first(self.end)
        space = "[ \\t\\r\\n]{0,4}"  # bounded: a model must not spend its budget on blank lines
        if inside:
            return f"/{thinking}{space}/"
        return f"/{space}{''.join(_hex(c) for c in self.start)}{thinking}{space}/?"

    def scan(self, text: str, position: Position, final: bool) -> _Scan:
        """(reasoning, content) decided of ``text`` read from ``position``, how much of it was consumed, and
        the position after it. When not ``final`` it stops before a possible start of a tag and before
        whitespace the next text decides; what it returns holds whatever text follows, so a stream scans
        what it holds on every piece and equals one scan of the whole text."""
        reasoning, index = "", 0
        if position is Position.BEFORE:
            first = len(text) - len(text.lstrip())
            rest = text[first:]
            if rest.startswith(self.start):
                position, index = Position.REASONING_START, first + len(self.start)
            elif not final and (not rest or self.start.startswith(rest)):
                return _Scan("", "", 0, position)  # whitespace so far, or maybe the start tag
            else:
                return _Scan("", text, len(text), Position.CONTENT)
        if position in (Position.REASONING_START, Position.REASONING):
            close = text.find(self.end, index)
            if close < 0 and not final:  # the end tag may be starting; trailing whitespace may be the last
                end = len(text) - _partial_tag_length(text[index:], self.end)
                piece = text[index:end]
                if position is Position.REASONING_START:
                    piece = piece.lstrip()
                    if piece:
                        position = Position.REASONING
                kept = piece.rstrip()
                return _Scan(kept, "", end - (len(piece) - len(kept)), position)
            piece = text[index:len(text) if close < 0 else close]
            reasoning = (piece.lstrip() if position is Position.REASONING_START else piece).rstrip()
            if close < 0:
                return _Scan(reasoning, "", len(text), Position.REASONING)
            position, index = Position.CONTENT_START, close + len(self.end)
        if position is Position.CONTENT_START:
            index = len(text) - len(text[index:].lstrip())
            if index == len(text):
                return _Scan(reasoning, "", index, position)
        return _Scan(reasoning, text[index:], len(text), Position.CONTENT)


class StreamingReasoningParser:
    """One choice's reasoning split while it streams: ``feed`` new text, ``finish`` at the end."""

    def __init__(self, parser: ReasoningParser, inside: bool) -> None:
        self._parser = parser
        self._pending = ""
        self._position = Position.REASONING_START if inside else Position.BEFORE

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning piece, content piece) to send now."""
        return self._advance(text, final=False)

    def finish(self) -> tuple[str, str]:
        """End of generation: what was held back."""
        return self._advance("", final=True)

    def _advance(self, text: str, final: bool) -> tuple[str, str]:
        self._pending += text
        result = self._parser.scan(self._pending, self._position, final)
        self._pending = self._pending[result.consumed:]
        self._position = result.position
        return result.reasoning, result.content


REASONING_PARSERS: dict[str, type] = {
    "think": ReasoningParser, "qwen3": ReasoningParser, "deepseek_r1": ReasoningParser,
    "gpt_oss": HarmonyReasoningParser,  # harmony's analysis channel (router/harmony.py)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called ``name``; ValueError naming the known ones otherwise."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r} (known: {', '.join(sorted(REASONING_PARSERS))})")
    return REASONING_PARSERS[name]()
