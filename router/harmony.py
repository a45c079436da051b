"""gpt-oss's harmony output format, read out of generated text (special tokens kept), whole or streamed.

An answer is a run of messages, each a header and a body::

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "X"}<|call|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

(the prompt ends with ``<|start|>assistant``, so the first header starts at ``<|channel|>``; the recipient
``to=...`` may also sit before the channel). A body ends at ``<|end|>``, ``<|call|>``, ``<|return|>``, the
next header, or the end of the text. ``scan`` turns text into pieces: plain text outside any message,
body pieces with their channel and recipient, and whole calls (a body addressed to ``functions.NAME``
whose text is a JSON object). Like the other parsers, a scan that is not final stops before a possible
start of a marker, an unfinished header and an unfinished call, and what it returned stays true whatever
text follows; bodies other than calls stream as they come.

``HarmonyReasoningParser`` (the ``gpt_oss`` reasoning parser) sends analysis bodies to reasoning and final
bodies and preambles to content, and passes calls on in one canonical message each, which the ``harmony``
tool parser (``router/tool_parsers/harmony.py``) reads into tool calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
HEADER_STARTS = (START, CHANNEL)
BODY_ENDS = (END, CALL, RETURN)  # consumed with the body; a next header ends a body too, and is not consumed
FUNCTION_PREFIX = "functions."

_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass(frozen=True)
class Body:
    """A piece of one message's body."""

    text: str
    channel: str
    recipient: str | None


@dataclass(frozen=True)
class Call:
    """A whole function call: ``arguments`` is the JSON object's text as the model wrote it."""

    name: str
    arguments: str


@dataclass(frozen=True)
class OpenBody:
    """Scan state: inside the body of a message that is not a call."""

    channel: str
    recipient: str | None


class HarmonyScan(NamedTuple):
    pieces: list  # str (text outside messages), Body and Call, in text order
    consumed: int
    state: OpenBody | None


def _earliest(text: str, start: int, markers: tuple[str, ...]) -> tuple[int, str]:
    found = [(index, marker) for marker in markers if (index := text.find(marker, start)) >= 0]
    return min(found) if found else (-1, "")


def _partial_length(text: str, start: int, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text[start:]`` that is a proper start of one of ``markers``."""
    for length in range(min(max(map(len, markers)) - 1, len(text) - start), 0, -1):
        if any(marker.startswith(text[len(text) - length:]) for marker in markers):
            return length
    return 0


def canonical_call(call: Call) -> str:
    """A call as one message, the way the ``harmony`` tool parser reads it back."""
    return f"{CHANNEL}commentary to={FUNCTION_PREFIX}{call.name}{MESSAGE}{call.arguments}{CALL}"


def _as_call(recipient: str | None, body: str) -> Call | None:
    if not recipient or not recipient.startswith(FUNCTION_PREFIX) or len(recipient) == len(FUNCTION_PREFIX):
        return None
    arguments = body.strip()
    try:
        if not isinstance(json.loads(arguments), dict):
            return None
    except ValueError:
        return None
    return Call(recipient[len(FUNCTION_PREFIX):], arguments)


def scan(text: str, state: OpenBody | None, final: bool) -> HarmonyScan:
    """The pieces ``text`` decides when read in ``state``, how much of it they consumed, and the state after."""
    pieces: list = []
    index = 0
    while True:
        if state is not None:  # inside a body that streams
            stop, marker = _earliest(text, index, BODY_ENDS + HEADER_STARTS)
            if stop < 0:
                end = len(text) if final else len(text) - _partial_length(text, index, BODY_ENDS + HEADER_STARTS)
                if end > index:
                    pieces.append(Body(text[index:end], state.channel, state.recipient))
                return HarmonyScan(pieces, end, None if final else state)
            if stop > index:
                pieces.append(Body(text[index:stop], state.channel, state.recipient))
            index, state = stop + (len(marker) if marker in BODY_ENDS else 0), None
            continue
        header, marker = _earliest(text, index, HEADER_STARTS)
        if header < 0:
            end = len(text) if final else len(text) - _partial_length(text, index, HEADER_STARTS)
            if end > index:
                pieces.append(text[index:end])
            return HarmonyScan(pieces, end, None)
        if header > index:
            pieces.append(text[index:header])
        header_end = text.find(MESSAGE, header)
        if header_end < 0:  # an unfinished header: more text may finish it; at the end it says nothing
            return HarmonyScan(pieces, len(text) if final else header, None)
        header_text = text[header:header_end]
        channel_match, recipient_match = _CHANNEL_NAME.search(header_text), _RECIPIENT.search(header_text)
        channel = channel_match.group(1) if channel_match else ""
        recipient = recipient_match.group(1) if recipient_match else None
        body_start = header_end + len(MESSAGE)
        if recipient and recipient.startswith(FUNCTION_PREFIX):  # a call is decided whole
            stop, marker = _earliest(text, body_start, BODY_ENDS + HEADER_STARTS)
            if stop < 0 and not final:
                return HarmonyScan(pieces, header, None)
            body_end = len(text) if stop < 0 else stop
            call = _as_call(recipient, text[body_start:body_end])
            pieces.append(call if call is not None else Body(text[body_start:body_end], channel, recipient))
            index = body_end + (len(marker) if marker in BODY_ENDS else 0)
            continue
        index, state = body_start, OpenBody(channel, recipient)


class HarmonyReasoningParser:
    """The ``gpt_oss`` reasoning parser: analysis bodies are reasoning; final bodies, preambles and text outside
    messages are content; calls go on in content as canonical messages for the ``harmony`` tool parser.
    Same interface as ``router.reasoning.ReasoningParser``; harmony's markers are special tokens, so the
    answer is detokenized with them (``needs_special_tokens``)."""

    name: ClassVar[str] = "gpt_oss"
    needs_special_tokens: ClassVar[bool] = True
    end: ClassVar[str] = END

    def starts_inside(self, prompt_text: str) -> bool:
        return False  # every message opens with its own header

    def extract(self, text: str, inside: bool = False) -> tuple[str | None, str]:
        """(reasoning, content) of a whole answer; reasoning None when it has no analysis message."""
        result = scan(text, None, final=True)
        reasoning, content = self._split(result.pieces)
        is_thinking = any(isinstance(piece, Body) and piece.channel == "analysis" for piece in result.pieces)
        return (reasoning if is_thinking else None), content

    def streaming(self, inside: bool = False) -> "StreamingHarmony":
        return StreamingHarmony(self)

    def grammar_prefix(self, inside: bool) -> None:
        """None: a constrained answer is not held to harmony's headers (they are special tokens the grammar
        would have to name by id); docs/models.md says so."""
        return None

    @staticmethod
    def _split(pieces: list) -> tuple[str, str]:
        reasoning, content = [], []
        for piece in pieces:
            if isinstance(piece, Call):
                content.append(canonical_call(piece))
            elif isinstance(piece, Body) and piece.channel == "analysis":
                reasoning.append(piece.text)
            else:
                content.append(piece if isinstance(piece, str) else piece.text)
        return "".join(reasoning), "".join(content)


class StreamingHarmony:
    """One choice's harmony reasoning split while it streams: ``feed`` new text, ``finish`` at the end."""

    def __init__(self, parser: HarmonyReasoningParser) -> None:
        self._pending = ""
        self._state: OpenBody | None = None

    def feed(self, text: str) -> tuple[str, str]:
        return self._advance(text, final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance("", final=True)

    def _advance(self, text: str, final: bool) -> tuple[str, str]:
        self._pending += text
        result = scan(self._pending, self._state, final)
        self._pending, self._state = self._pending[result.consumed:], result.state
        return HarmonyReasoningParser._split(result.pieces)
