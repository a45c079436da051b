"""gpt-oss's harmony format on hand-written answers: the gpt_oss reasoning parser (analysis -> reasoning, final ->
content) and the harmony tool parser (commentary to=functions.NAME -> tool calls), whole and streamed alike, and
both together as a chat answer's fields."""

from __future__ import annotations

import json
import random

import pytest

from router.chat_output import ChatOutputFormat
from router.errors import APIError
from router.reasoning import get_reasoning_parser
from router.tool_parsers import get_tool_parser, infer_tool_parser

REASONING = get_reasoning_parser("gpt_oss")
TOOLS = get_tool_parser("harmony")

THINK = "<|channel|>analysis<|message|>The user asks for the weather. I should call get_weather.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris", "unit": "celsius"}<|call|>')
CALL_RECIPIENT_FIRST = ('<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>'
                        '{"zone": "UTC"}')  # <|call|> was the stop token and is not in the text
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 18 degrees in Paris."
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"

# (text, reasoning, content, calls as (name, arguments))
EXAMPLES = [
    (THINK + FINAL, "The user asks for the weather. I should call get_weather.", "It is 18 degrees in Paris.", []),
    (THINK + CALL, "The user asks for the weather. I should call get_weather.", "",
     [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    (THINK + PREAMBLE + CALL_RECIPIENT_FIRST, "The user asks for the weather. I should call get_weather.",
     "Let me check.", [("get_time", '{"zone": "UTC"}')]),
    ("<|channel|>analysis<|message|>Two calls.<|end|>" + CALL + CALL_RECIPIENT_FIRST, "Two calls.", "",
     [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"zone": "UTC"}')]),
    ("<|channel|>final<|message|>No thinking at all.<|return|>", None, "No thinking at all.", []),
    ("<|channel|>analysis<|message|>Cut short while thinking", "Cut short while thinking", "", []),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|chan", "a", "", []),  # an unfinished header
    ("Plain text, no harmony.", None, "Plain text, no harmony.", []),
    # a call whose body is not a JSON object is content, not a call
    ("<|channel|>commentary to=functions.f<|message|>not json<|call|>", None, "not json", []),
    ("", None, "", []),
]


def through_both(text: str) -> tuple[str | None, str, list[tuple[str, str]]]:
    reasoning, content = REASONING.extract(text)
    content, calls = TOOLS.extract(content)
    return reasoning, content, [(call.name, call.arguments) for call in calls]


def streamed_through_both(pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    reasoning_stream, tool_stream = REASONING.streaming(False), TOOLS.streaming()
    reasoning, content, calls = [], [], []
    for piece in pieces + [None]:
        thought, said = reasoning_stream.feed(piece) if piece is not None else reasoning_stream.finish()
        said, deltas = tool_stream.feed(said)
        if piece is None:
            more, more_deltas = tool_stream.finish()
            said, deltas = said + more, deltas + more_deltas
        reasoning.append(thought)
        content.append(said)
        calls.extend((delta.name, delta.arguments) for delta in deltas)
    return "".join(reasoning), "".join(content), calls


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("text, reasoning, content, calls", EXAMPLES)
def test_reasoning_then_tool_parser(text, reasoning, content, calls):
    assert through_both(text) == (reasoning, content, calls)


@pytest.mark.parametrize("text, reasoning, content, calls", EXAMPLES)
def test_streaming_equals_whole_under_any_split(text, reasoning, content, calls):
    rng = random.Random(text)
    for pieces in [[text], list(text)] + [random_split(text, rng) for _ in range(20)]:
        assert streamed_through_both(pieces) == (reasoning or "", content, calls), pieces


def test_tool_parser_alone_reads_raw_harmony():
    """Without the reasoning parser the thinking stays in the content, as for every other format."""
    content, calls = TOOLS.extract(THINK + PREAMBLE + CALL)
    assert content == "The user asks for the weather. I should call get_weather.Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_thinking_streams_as_it_comes_and_a_call_comes_whole():
    stream = REASONING.streaming(False)
    assert stream.feed("<|channel|>analysis<|mess") == ("", "")  # a header is decided whole
    assert stream.feed("age|>Let me") == ("Let me", "")
    assert stream.feed(" think<|e") == (" think", "")  # maybe a marker: held
    assert stream.feed("nd|>" + CALL[:60]) == ("", "")  # the call is not complete yet
    reasoning, content = stream.feed(CALL[60:])
    assert reasoning == "" and TOOLS.extract(content)[1][0].name == "get_weather"


def test_chat_answer_fields():
    fmt = ChatOutputFormat(tool_parser=TOOLS, reasoning=REASONING)
    message = fmt.message(THINK + CALL)
    assert message["reasoning_content"] == "The user asks for the weather. I should call get_weather."
    assert message["content"] is None
    assert [call["function"]["name"] for call in message["tool_calls"]] == ["get_weather"]
    assert fmt.message(THINK + FINAL) == {"reasoning_content": "The user asks for the weather. I should call "
                                          "get_weather.", "content": "It is 18 degrees in Paris."}
    # cut off while thinking: the thinking is all there is, and content is null (vLLM's parsers say None too)
    assert fmt.message(THINK) == {"reasoning_content": "The user asks for the weather. I should call get_weather.",
                                  "content": None}


def test_registration_and_what_is_not_supported():
    assert REASONING.needs_special_tokens and TOOLS.needs_special_tokens  # the markers are special tokens
    assert not REASONING.starts_inside("<|start|>user<|message|>hi<|end|><|start|>assistant")
    assert REASONING.grammar_prefix(False) is None
    assert infer_tool_parser("...{{- '<|start|>assistant<|channel|>' }}...<|call|>...") == "harmony"
    with pytest.raises(APIError):
        TOOLS.call_grammar([{"name": "f", "parameters": {}}], False, None)
