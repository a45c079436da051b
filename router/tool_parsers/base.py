"""What every tool-call format shares: the call records, the parser interface, the streaming driver, and
the JSON and grammar helpers the formats are written with.

A format is one ``scan`` function over text it has not consumed yet. ``scan`` returns the content and
calls it has decided, how much text it consumed, and its state (what it needs to know about the text
behind it). When ``final`` is False it stops where more text could change a decision (a possible start
of a marker, an open call, whitespace that a following call would drop), and everything it returned
stays true whatever text comes next. ``extract`` is one final scan; ``StreamingToolParser`` scans what
it holds on every piece. Both run the same decisions, so streamed output equals the whole text's output.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from pipeline.structured_output.closed_objects import closed_objects
from router.tool_parsers.schema_refs import hoist_definitions


def new_call_id() -> str:
    """An OpenAI-style tool call id: "call_" and 24 random hex characters."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    """One call the model made: ``arguments`` is the JSON text of its arguments object as the model wrote it."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)


@dataclass
class ToolCallDelta:
    """One streamed piece of one call, as OpenAI's ``delta.tool_calls[i]``: ``id`` and ``name`` only on a
    call's first delta, ``arguments`` the next piece of its arguments text."""

    index: int
    id: str | None
    name: str | None
    arguments: str


class Scan(NamedTuple):
    """What one scan decided: ``content`` and ``calls`` (in text order), how many characters of the text
    it ``consumed`` (the rest is scanned again with more text), and the ``state`` to scan the rest in."""

    content: str
    calls: list[ToolCall]
    consumed: int
    state: Any


class ToolParser:
    """One tool-call format (stateless; ``get_tool_parser`` makes them)."""

    name: ClassVar[str] = ""
    # The format's markers are special tokens: detokenize with skip_special_tokens=False, or they vanish.
    needs_special_tokens: ClassVar[bool] = False
    initial_state: ClassVar[Any] = None

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole generated text; text that is not a well-formed call stays content."""
        result = self.scan(text, self.initial_state, final=True)
        return result.content, result.calls

    def streaming(self) -> "StreamingToolParser":
        """Fresh state for one choice's stream."""
        return StreamingToolParser(self)

    def scan(self, text: str, state: Any, final: bool) -> Scan:  # pragma: no cover - abstract
        raise NotImplementedError

    def text_or_calls_grammar(self, tools: list[dict], parallel: bool, tokenizer) -> str | None:
        """Rules (entry ``tc_text_or_calls``) for ``tool_choice`` auto with strict tools: free text that never
        starts a call, optionally followed by calls held to their schemas; None where the format cannot
        say that (its marker is a special token, or there is none)."""
        return None

    def call_grammar(self, tools: list[dict], parallel: bool, tokenizer) -> str:  # pragma: no cover - abstract
        """An llguidance Lark fragment defining ``tool_calls`` (helpers named ``tc_*``, no ``start``): exactly
        one call (``parallel`` False) or one or more, in this format, each call's JSON held to its tool's schema."""
        raise NotImplementedError


class StreamingToolParser:
    """One choice's tool-call parsing while it streams: ``feed`` each new piece of text, ``finish`` at the end.

    Holds back only what more text could still turn into (or out of) a call; a call is sent whole, as one
    delta with its id, name and arguments, once it is complete, since one that breaks later was never a call.
    """

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._pending = ""
        self._state = parser.initial_state
        self._num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Content to show now and call deltas now, after ``text`` arrived."""
        return self._advance(text, final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of generation: everything held back, as content or as the calls it completes."""
        return self._advance("", final=True)

    def _advance(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        self._pending += text
        result = self._parser.scan(self._pending, self._state, final)
        self._pending = self._pending[result.consumed:]
        self._state = result.state
        deltas = [ToolCallDelta(index=self._num_calls + k, id=call.id, name=call.name, arguments=call.arguments)
                  for k, call in enumerate(result.calls)]
        self._num_calls += len(deltas)
        return result.content, deltas


# ------------------------------------------------------------------ text helpers
def skip_space(text: str, index: int) -> int:
    """The first index at or after ``index`` that is not whitespace (``len(text)`` if none)."""
    while index < len(text) and text[index].isspace():
        index += 1
    return index


def end_of_text_before_space(text: str, start: int, end: int) -> int:
    """``end`` less the whitespace right before it, not going below ``start``."""
    while end > start and text[end - 1].isspace():
        end -= 1
    return end


def partial_marker_length(text: str, start: int, marker: str) -> int:
    """Length of the longest end of ``text[start:]`` that is a proper start of ``marker`` (0 if none)."""
    for length in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


class Undecided:
    """A call that more text could still complete (only when a scan is not final)."""


NEED_MORE = Undecided()


class MarkedToolParser(ToolParser):
    """A format whose calls each open with ``marker`` anywhere in the text (hermes, mistral), with content
    around them. Whitespace next to a call block is dropped; a marker whose block is not a well-formed call
    is content, and scanning goes on right after it. State: whether the text follows a call block."""

    marker: ClassVar[str] = ""
    initial_state = False

    def parse_block(self, text: str, start: int, final: bool) -> tuple[list[ToolCall], int] | Undecided | None:
        """The calls of the block whose marker ends at ``start``, and where the block ends; ``NEED_MORE``
        when more text could still decide it (never when ``final``); None when it is not a call block."""
        raise NotImplementedError  # pragma: no cover - abstract

    def scan(self, text: str, state: bool, final: bool) -> Scan:
        pieces: list[str] = []
        calls: list[ToolCall] = []
        index, after_call = 0, state
        while True:
            if after_call:
                index = skip_space(text, index)
                if index == len(text):
                    return Scan("".join(pieces), calls, index, True)
                after_call = False
            found = text.find(self.marker, index)
            if found < 0:
                end = len(text)
                if not final:  # hold a possible start of the marker, and the whitespace a call would drop
                    end = end_of_text_before_space(text, index, end - partial_marker_length(text, index, self.marker))
                pieces.append(text[index:end])
                return Scan("".join(pieces), calls, end, False)
            block_start = found + len(self.marker)
            block = self.parse_block(text, block_start, final)
            if block is NEED_MORE:
                end = end_of_text_before_space(text, index, found)
                pieces.append(text[index:end])
                return Scan("".join(pieces), calls, end, False)
            if block is None:
                pieces.append(text[index:block_start])
                index = block_start
                continue
            pieces.append(text[index:end_of_text_before_space(text, index, found)])
            block_calls, index = block
            calls.extend(block_calls)
            after_call = True


# ------------------------------------------------------------------ JSON helpers
_JSON_SPACE = " \t\n\r"
_JSON_STRUCTURE = re.compile(r'["{}\[\]]')
_STRING_END = re.compile(r'["\\]')


def json_extent(text: str, start: int) -> int | None:
    """End of the JSON object or array opening at ``text[start]``, by brackets outside strings; None when
    the text ends first. On valid JSON this is where it ends; if that span is not valid JSON, no text
    after it can make it valid, so a streaming parser may decide there."""
    depth, index = 0, start
    while True:
        match = _JSON_STRUCTURE.search(text, index)
        if match is None:
            return None
        index = match.end()
        char = match.group()
        if char == '"':
            while True:  # skip the string, escapes included
                end = _STRING_END.search(text, index)
                if end is None:
                    return None
                if end.group() == '"':
                    index = end.end()
                    break
                index = end.end() + 1
            continue
        depth += 1 if char in "{[" else -1
        if depth == 0:
            return index


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constants)


def skip_json_space(text: str, index: int) -> int:
    while index < len(text) and text[index] in _JSON_SPACE:
        index += 1
    return index


def json_members(text: str, start: int, end: int) -> dict[str, tuple[Any, int, int]] | None:
    """The members of the JSON object that is exactly ``text[start:end]``: key -> (value, value start,
    value end), so a value's text is a slice of the model's own; None when it is not one strict JSON object."""
    if text[start:start + 1] != "{":
        return None
    members: dict[str, tuple[Any, int, int]] = {}
    try:
        index = skip_json_space(text, start + 1)
        if text[index:index + 1] == "}":
            return members if index + 1 == end else None
        while True:
            if text[index:index + 1] != '"':
                return None
            key, index = json.decoder.scanstring(text, index + 1)
            index = skip_json_space(text, index)
            if text[index:index + 1] != ":":
                return None
            index = skip_json_space(text, index + 1)
            value, value_end = _DECODER.raw_decode(text, index)
            members[key] = (value, index, value_end)
            index = skip_json_space(text, value_end)
            if text[index:index + 1] == ",":
                index = skip_json_space(text, index + 1)
            elif text[index:index + 1] == "}":
                return members if index + 1 == end else None
            else:
                return None
    except (ValueError, IndexError):  # JSONDecodeError is a ValueError
        return None


def call_from_members(text: str, members: dict | None, argument_keys: tuple[str, ...],
                      **call_fields: str) -> ToolCall | None:
    """A ``ToolCall`` from a call object's members: a non-empty string ``name`` and an object (or absent or
    null) under the first of ``argument_keys`` present; None when the object is not a call."""
    if members is None or not isinstance(members.get("name", (None,))[0], str) or not members["name"][0]:
        return None
    for key in argument_keys:
        if key in members:
            value, start, end = members[key]
            if value is None:
                break
            if not isinstance(value, dict):
                return None
            return ToolCall(name=members["name"][0], arguments=text[start:end], **call_fields)
    return ToolCall(name=members["name"][0], arguments="{}", **call_fields)


# ------------------------------------------------------------------ grammar helpers
# The JSON a call's schema admits is laid out as Python's json.dumps writes it, which is how these
# models saw their calls in training; one layout also keeps a weak model from padding with whitespace.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_names_and_parameters(tools: list[dict]) -> list[tuple[str, dict]]:
    """(name, parameters schema) per tool; a tool without parameters takes any object."""
    if not tools:
        raise ValueError("call_grammar: no tools")
    return [(tool["name"], tool.get("parameters") or {"type": "object"}) for tool in tools]


def call_object_schema(name: str, parameters: dict, arguments_key: str) -> dict:
    """The schema of ``{"name": name, arguments_key: {...}}``, name first, nothing else."""
    return {"type": "object", "properties": {"name": {"const": name}, arguments_key: closed_objects(parameters)},
            "required": ["name", arguments_key], "additionalProperties": False}


def inline_json(schema: dict) -> str:
    """``schema`` as an llguidance ``%json`` node, laid out as ``JSON_LAYOUT`` says."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_LAYOUT})


def any_call_schema(tools: list[dict], arguments_key: str) -> dict:
    """One call object of any of ``tools``; the tools' own definitions (``$defs``) at its root, where their
    ``$ref``s point (``schema_refs``): a schema that nests this one moves ``$defs`` to its own root."""
    definitions: dict = {}
    schemas = [call_object_schema(name, hoist_definitions(closed_objects(parameters), f"tool{number}_", definitions),
                                  arguments_key)
               for number, (name, parameters) in enumerate(tool_names_and_parameters(tools))]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {**schema, "$defs": definitions} if definitions else schema


def lark_string(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def special_token_id(tokenizer, token: str) -> int | None:
    """The id of ``token`` when it is a special token of ``tokenizer`` (then text never spells it), else None."""
    if tokenizer is None:
        return None
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == getattr(tokenizer, "unk_token_id", None):
        return None
    added = getattr(tokenizer, "added_tokens_decoder", {}).get(token_id)
    if token in getattr(tokenizer, "all_special_tokens", ()) or getattr(added, "special", False):
        return token_id
    return None


def marker_symbol(tokenizer, marker: str) -> str:
    """``marker`` in a Lark rule: by token id when it is a special token, else as text."""
    token_id = special_token_id(tokenizer, marker)
    return f"<[{token_id}]>" if token_id is not None else lark_string(marker)
