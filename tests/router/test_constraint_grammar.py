"""A request's constraint placed after the thinking (router.constraint_grammar): each kind compiles with
llguidance and holds the answer, not the thinking, and what cannot be composed is a 400."""

from __future__ import annotations

import json

import pytest

from pipeline.protocol import StructuredOutput
from pipeline.structured_output.backend import LLGuidanceBackend
from router.constraint_grammar import combined_constraint
from router.errors import APIError
from router.reasoning import get_reasoning_parser
from tests.tool_checkpoint import MARKERS

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def backend():
    from pipeline.builtin_model import build_tokenizer

    tokenizer = build_tokenizer(vocab_size=400)
    tokenizer.add_tokens(MARKERS)  # <think> and </think> are text, as in Qwen3
    backend = LLGuidanceBackend(tokenizer, len(tokenizer))
    backend.tokenizer = tokenizer
    return backend


def accepts(backend, spec: StructuredOutput, text: str) -> bool:
    matcher = backend.matcher(spec)
    ids = backend.tokenizer(text, add_special_tokens=False)["input_ids"]
    return all(matcher.accept(t) for t in ids) and matcher.accept(backend.tokenizer.eos_token_id)


SPECS = {
    "json": (StructuredOutput(kind="json", value=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                              "required": ["a"]})), '{"a":1}', '{"b":1}'),
    "json_object": (StructuredOutput(kind="json_object"), '{"x":true}', "[1]"),
    "regex": (StructuredOutput(kind="regex", value="(yes|no)/[0-9]"), "no/7", "maybe"),
    # a slash a client escaped already (closing tags: <\/x>) was escaped again into a lexer error
    "regex_escaped_slash": (StructuredOutput(kind="regex", value=r"<x>[a-z]+<\/x>"), "<x>ok</x>", "<x>ok<x>"),
    "choice": (StructuredOutput(kind="choice", choices=["red", 'say "hi"']), 'say "hi"', "blue"),
}


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("inside", [True, False])
def test_the_constraint_holds_after_the_thinking(backend, kind, inside):
    spec, good, bad = SPECS[kind]
    reasoning = get_reasoning_parser("think")
    composed = combined_constraint(spec, None, reasoning.grammar_prefix(inside))
    assert composed.kind == "grammar" and composed.backend == "llguidance"
    thinking = ("" if inside else "<think>") + "free {text} here, not json</think>\n\n"
    assert accepts(backend, composed, thinking + good)
    assert not accepts(backend, composed, thinking + bad)
    assert not accepts(backend, composed, thinking + good + "</think>")
    if not inside:  # thinking is optional when the prompt did not open it
        assert accepts(backend, composed, good)


def test_without_reasoning_the_constraint_is_unchanged(backend):
    spec = SPECS["regex"][0]
    assert combined_constraint(spec, None, None) is spec
    assert combined_constraint(None, None, get_reasoning_parser("think").grammar_prefix(True)) is None


def test_what_cannot_be_composed_is_a_400():
    grammar = StructuredOutput(kind="grammar", value='start: "a"')
    with pytest.raises(APIError) as info:
        combined_constraint(grammar, None, get_reasoning_parser("think").grammar_prefix(False))
    assert info.value.status_code == 400 and "reasoning" in info.value.message
    assert "tool_choice auto" not in info.value.message  # only what it was combined with
    with pytest.raises(APIError) as info:
        combined_constraint(SPECS["json"][0], "tool_calls: \"x\"", None)
    assert info.value.param == "tool_choice"


def test_strict_tools_under_auto_allow_text_and_hold_a_call_to_its_schema(backend):
    from router.tool_parsers import get_tool_parser

    tools = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                    "required": ["city"], "additionalProperties": False}}]
    rules = get_tool_parser("hermes").text_or_calls_grammar(tools, False, backend.tokenizer)
    spec = combined_constraint(None, (rules, "tc_text_or_calls"), None)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts(backend, spec, "Just text, no call at all.")
    assert accepts(backend, spec, "Let me look.\n" + call)
    assert not accepts(backend, spec, call.replace("get_weather", "get_time"))
    assert not accepts(backend, spec, call.replace('"city": "Paris"', '"town": "Paris"'))
    assert not accepts(backend, spec, "text " + call + " and more text")
    thinking = combined_constraint(None, (rules, "tc_text_or_calls"),
                                   get_reasoning_parser("think").grammar_prefix(True))
    assert accepts(backend, thinking, "hmm</think>\n\n" + call)


@pytest.mark.parametrize("thinking", [False, True])
def test_under_auto_a_response_format_or_the_calls(backend, thinking):
    """Tools under tool_choice auto beside a response format (an agent with tools and a typed final answer): the
    answer is the format, or calls held to their schemas, and nothing else."""
    from router.tool_parsers import get_tool_parser

    tools = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                    "required": ["city"], "additionalProperties": False}}]
    calls = (get_tool_parser("hermes").call_grammar(tools, True, backend.tokenizer), "tool_calls")
    prefix = get_reasoning_parser("think").grammar_prefix(True) if thinking else None
    spec = combined_constraint(SPECS["json"][0], None, prefix, calls_instead=calls)
    before = "hmm</think>\n\n" if thinking else ""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts(backend, spec, before + '{"a":1}')
    assert accepts(backend, spec, before + call)
    assert not accepts(backend, spec, before + '{"b":1}')
    assert not accepts(backend, spec, before + "Free text.")
    assert not accepts(backend, spec, before + call.replace('"city"', '"town"'))
