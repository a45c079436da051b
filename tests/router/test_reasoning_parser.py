"""router.reasoning: thinking split from the answer (whole and streamed alike), and the grammar prefix that
lets a constrained answer follow the thinking, walked token by token through the llguidance backend."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from pipeline.protocol import StructuredOutput
from router.reasoning import REASONING_PARSERS, get_reasoning_parser

PARSER = get_reasoning_parser("qwen3")

# (inside, text, expected reasoning, expected content)
EXAMPLES = [
    (False, "<think>\nLet me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
    (False, "  \n<think>a</think>b", "a", "b"),
    (False, "<think></think>Paris.", "", "Paris."),
    (False, "<think>\n\n</think>\n\n", "", ""),
    (False, "Paris, no thinking.", None, "Paris, no thinking."),
    (False, "  Paris with a leading space.", None, "  Paris with a leading space."),
    (False, "Paris. <think>late</think> is content", None, "Paris. <think>late</think> is content"),
    (False, "<think>\nStill thinking when it stopped  ", "Still thinking when it stopped", ""),
    (False, "<think>a < b and </thin k</think> ok", "a < b and </thin k", "ok"),
    (False, "<thin", None, "<thin"),
    (False, "", None, ""),
    (False, "  ", None, "  "),
    (True, "Let me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
    (True, "first</think>second</think>third", "first", "second</think>third"),
    (True, "  thinking, cut short </th", "thinking, cut short </th", ""),
    (True, "</think>Paris.", "", "Paris."),
    (True, "", "", ""),
    (True, "<think>nested?</think>  x  ", "<think>nested?", "x  "),
]


def streamed(inside: bool, pieces: list[str]) -> tuple[str, str]:
    stream = PARSER.streaming(inside)
    reasoning, content = [], []
    for piece in pieces + [None]:
        got = stream.feed(piece) if piece is not None else stream.finish()
        reasoning.append(got[0])
        content.append(got[1])
    return "".join(reasoning), "".join(content)


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("inside, text, reasoning, content", EXAMPLES)
def test_extract(inside, text, reasoning, content):
    assert PARSER.extract(text, inside) == (reasoning, content)


@pytest.mark.parametrize("inside, text, reasoning, content", EXAMPLES)
def test_streaming_equals_extract_under_any_split(inside, text, reasoning, content):
    rng = random.Random(text)
    for pieces in [[text], list(text)] + [random_split(text, rng) for _ in range(20)]:
        assert streamed(inside, pieces) == (reasoning or "", content), pieces


@pytest.mark.parametrize("inside", [False, True])
def test_streaming_equals_extract_on_random_texts(inside):
    blocks = ["<think>", "</think>", "<th", "ink>", "</", "think", ">", " ", "\n", "a", "b c"]
    rng = random.Random(int(inside))
    for _ in range(400):
        text = "".join(rng.choice(blocks) for _ in range(rng.randint(0, 8)))
        reasoning, content = PARSER.extract(text, inside)
        assert streamed(inside, random_split(text, rng)) == (reasoning or "", content), text
        assert streamed(inside, list(text)) == (reasoning or "", content), text


def test_streaming_holds_back_only_what_is_undecided():
    stream = PARSER.streaming(inside=False)
    assert stream.feed("<think>\n") == ("", "")
    assert stream.feed("The user wants ") == ("The user wants", "")  # the space may end the reasoning
    assert stream.feed("Paris.\n</th") == (" Paris.", "")  # maybe the end tag
    assert stream.feed("ink>\n\n") == ("", "")
    assert stream.feed("It is ") == ("", "It is ")
    assert stream.feed("sunny.") == ("", "sunny.")
    assert stream.finish() == ("", "")
    plain = PARSER.streaming(inside=False)
    assert plain.feed("Hello") == ("", "Hello") and plain.feed(" <think>") == ("", " <think>")


def test_starts_inside():
    assert PARSER.starts_inside("<|im_start|>assistant\n<think>\n")
    assert not PARSER.starts_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not PARSER.starts_inside("<|im_start|>assistant\n")
    assert PARSER.starts_inside("<think>old</think> ... <|Assistant|><think>\n")


def test_registry():
    assert set(REASONING_PARSERS) >= {"think", "qwen3", "deepseek_r1"}
    assert get_reasoning_parser("deepseek_r1").extract("a</think>b", True) == ("a", "b")
    with pytest.raises(ValueError, match="deepseek_r1, gpt_oss, qwen3, think"):
        get_reasoning_parser("nope")


# ------------------------------------------------------------------ grammar prefix
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}
ANSWER = json.dumps({"city": "Paris"})


@pytest.fixture(scope="module")
def qwen3_like():
    """A tokenizer with ``<think>`` and ``</think>`` as added, not special, tokens (as Qwen3's), and its backend."""
    from pipeline.builtin_model import build_tokenizer
    from pipeline.structured_output.backend import LLGuidanceBackend

    tokenizer = build_tokenizer(vocab_size=512)
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer, LLGuidanceBackend(tokenizer, len(tokenizer))


def walk(qwen3_like, grammar: str, text: str) -> bool:
    """Whether the grammar takes ``text`` token by token and then ends (EOS taken, or nothing more allowed)."""
    tokenizer, backend = qwen3_like
    matcher = backend.matcher(StructuredOutput(kind="grammar", value=grammar))
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        if not matcher.accept(token):
            return False
    return matcher.is_finished or (matcher.accept(tokenizer.eos_token_id) and matcher.is_finished)


@pytest.mark.parametrize("inside, text, valid", [
    (True, "The user wants JSON.\n</think>\n\n" + ANSWER, True),
    (True, "</think>" + ANSWER, True),
    (True, "tricky < </thin <</think> " + ANSWER, True),
    (True, ANSWER, False),  # the thinking never ends
    (True, "a</think>b</think>" + ANSWER, False),  # the thinking ends at the first end tag
    (True, "a</think>\n" + json.dumps({"town": "Paris"}), False),
    (False, "<think>\nThe user wants JSON.\n</think>\n\n" + ANSWER, True),
    (False, "\n<think></think>" + ANSWER, True),
    (False, ANSWER, True),  # no thinking at all
    (False, "Sure: " + ANSWER, False),
    (False, "<think>a</think>\n</think>" + ANSWER, False),
    (False, "<think>a" + ANSWER, False),
])
def test_grammar_prefix_then_a_json_answer(qwen3_like, inside, text, valid):
    grammar = f"start: {PARSER.grammar_prefix(inside)} answer\nanswer: %json {json.dumps(SCHEMA)}\n"
    assert walk(qwen3_like, grammar, text) == valid
    if valid:  # the parser finds the constrained answer as the content
        reasoning, content = PARSER.extract(text, inside)
        jsonschema.validate(json.loads(content), SCHEMA)
        assert (reasoning is None) == (not inside and "<think>" not in text)
