"""router.tool_parsers: calls out of generated text (whole and streamed alike), and grammars that force a
well-formed call, walked token by token through the llguidance backend."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys

import jsonschema
import pytest

from pipeline.protocol import StructuredOutput
from router.tool_parsers import (TOOL_PARSERS, ToolCall, get_tool_parser, infer_tool_parser, new_call_id)

W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = '{"name": "get_time", "arguments": {"zone": "UTC", "nested": {"deep": [1, {"x": "}"}]}}}'
H = "<tool_call>\n{}\n</tool_call>".format
WEATHER = ("get_weather", '{"city": "Paris"}')
TIME = ("get_time", '{"zone": "UTC", "nested": {"deep": [1, {"x": "}"}]}}')
ESCAPED_ARGUMENTS = json.dumps({"q": 'say "} now', "path": "C:\\"})  # escapes, a brace in a string
ESCAPED = '{"name": "say", "parameters": ' + ESCAPED_ARGUMENTS + "}"

# DeepSeek's markers, and its calls in V3's layout (fenced JSON) and in V3.1's
DS_BLOCK, DS_BLOCK_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def ds_v3(name: str, arguments: str) -> str:
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{arguments}\n```{DS_CALL_END}"


def ds_v31(name: str, arguments: str) -> str:
    return f"{DS_CALL}{name}{DS_SEP}{arguments}{DS_CALL_END}"


# (parser, text, expected content, expected [(name, arguments)])
CALLS = [
    ("hermes", "Sure.\n" + H(W) + "\n", "Sure.", [WEATHER]),
    ("hermes", H(W) + "\n" + H(T), "", [WEATHER, TIME]),
    ("hermes", "<tool_call>" + W + "</tool_call>", "", [WEATHER]),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>', "", [WEATHER]),
    ("hermes", '<tool_call>{"name": "now"}</tool_call>', "", [("now", "{}")]),
    ("hermes", '<tool_call>{"name": "now", "arguments": null}</tool_call>', "", [("now", "{}")]),
    ("hermes", "A " + H(W) + " mid " + H(T) + " end", "Amidend", [WEATHER, TIME]),
    ("hermes", "x <tool_call>bad " + H(W), "x <tool_call>bad", [WEATHER]),
    ("hermes", "Sure. <tool_call>\n" + W + "\n", "Sure.", [WEATHER]),  # stopped on the closing tag: JSON whole
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [WEATHER]),
    ("llama3_json", ' <|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [WEATHER]),
    ("llama3_json", W + "; " + T + ";" + W, "", [WEATHER, TIME, WEATHER]),
    ("llama3_json", W + "\n\nThat is all.", "That is all.", [WEATHER]),
    ("llama3_json", ESCAPED + " then", "then", [("say", ESCAPED_ARGUMENTS)]),  # quotes and braces in strings
    ("llama3_json", W + "; {broken", "; {broken", [WEATHER]),
    ("llama3_json", W + ";", ";", [WEATHER]),
    ("mistral", "Let me check. [TOOL_CALLS][" + W + ", " + T + "]", "Let me check.", [WEATHER, TIME]),
    ("mistral", "[TOOL_CALLS] [" + W + "]\n", "", [WEATHER]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]' + TIME[1], "",
     [WEATHER, TIME]),
    ("mistral", "[TOOL_CALLS]say[ARGS]" + ESCAPED_ARGUMENTS + " ok", "ok", [("say", ESCAPED_ARGUMENTS)]),
    ("deepseek_v3", "Let me check." + DS_BLOCK + ds_v3(*WEATHER) + "\n" + ds_v3(*TIME) + DS_BLOCK_END, "Let me check.",
     [WEATHER, TIME]),
    ("deepseek_v3", DS_BLOCK + ds_v31(*WEATHER) + ds_v3(*TIME) + DS_BLOCK_END + "\nDone.", "Done.", [WEATHER, TIME]),
    ("deepseek_v3", DS_BLOCK + ds_v3("say", ESCAPED_ARGUMENTS), "", [("say", ESCAPED_ARGUMENTS)]),  # no end marker
    ("deepseek_v3", DS_BLOCK + ds_v3(*WEATHER) + " then " + ds_v3(*TIME), "then " + ds_v3(*TIME), [WEATHER]),
    ("deepseek_v31", DS_BLOCK + ds_v31(*WEATHER) + ds_v31(*TIME) + DS_BLOCK_END, "", [WEATHER, TIME]),
    ("deepseek_v31", "Sure. " + DS_BLOCK + " " + ds_v31("now", "{}") + " " + DS_BLOCK_END + " ok", "Sure.ok",
     [("now", "{}")]),
]
# (parser, text): no well-formed call in it, so all of it is content, as written
NOT_CALLS = [
    ("hermes", "Hello, no calls at all."),
    ("hermes", "a <tool x"),
    ("hermes", "Use the <tool_call> tag, then </tool_call>."),
    ("hermes", "<tool_call>{not json}</tool_call> ok"),
    ("hermes", '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}} x</tool_call>'),
    ("hermes", "Sure. <tool_call>\n" + W[:-9]),  # truncated mid-call
    ("hermes", "Sure. <tool_"),
    ("llama3_json", "The answer is " + W),
    ("llama3_json", "  {not json}"),
    ("llama3_json", '{"name": "f", "parameters": "x"}'),
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")'),
    ("llama3_json", W[:-3]),
    ("llama3_json", "<|python_ta"),
    ("llama3_json", "   "),
    ("mistral", "[TOOL_CALLS][" + W + ", 3]"),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": '),
    ("mistral", "[TOOL_CALLS]get weather[ARGS]{}"),
    ("mistral", "[TOOL_CALLS]f[AR"),
    ("mistral", "no calls [TOOL"),
    ("deepseek_v3", "No calls, just text."),
    ("deepseek_v3", DS_BLOCK + DS_BLOCK_END),
    ("deepseek_v3", DS_BLOCK + ds_v3("get_weather", '{"city": ')),  # cut mid-arguments
    ("deepseek_v3", DS_BLOCK + DS_CALL + "function" + DS_SEP + "get weather\n```json\n{}\n```" + DS_CALL_END),
    ("deepseek_v3", DS_BLOCK + ds_v3("f", "[1]") + DS_BLOCK_END),
    ("deepseek_v31", DS_BLOCK + ds_v31("f", '{"a": 1} x') + DS_BLOCK_END),
    ("deepseek_v31", "text " + DS_BLOCK[:7]),
]
EXAMPLES = CALLS + [(parser_name, text, text, []) for parser_name, text in NOT_CALLS]


def calls_of(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in calls]


def streamed(parser_name: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) per call, as a client joins the streamed pieces and deltas."""
    stream = get_tool_parser(parser_name).streaming()
    content, deltas = [], []
    for piece in pieces:
        text, new = stream.feed(piece)
        content.append(text)
        deltas.extend(new)
    text, new = stream.finish()
    content.append(text)
    deltas.extend(new)
    calls: dict[int, list] = {}
    for delta in deltas:
        if delta.index not in calls:
            assert delta.id and delta.name, "a call's first delta carries its id and name"
            calls[delta.index] = [delta.name, ""]
        else:
            assert delta.id is None and delta.name is None
        calls[delta.index][1] += delta.arguments
    assert sorted(calls) == list(range(len(calls)))
    return "".join(content), [tuple(calls[i]) for i in range(len(calls))]


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("parser_name, text, content, calls", EXAMPLES)
def test_extract(parser_name, text, content, calls):
    got_content, got_calls = get_tool_parser(parser_name).extract(text)
    assert (got_content, calls_of(got_calls)) == (content, calls)
    for call in got_calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("parser_name, text, content, calls", EXAMPLES)
def test_streaming_equals_extract_under_any_split(parser_name, text, content, calls):
    rng = random.Random(text)
    splits = [[text], list(text)] + [random_split(text, rng) for _ in range(20)]
    for pieces in splits:
        assert streamed(parser_name, pieces) == (content, calls), pieces


def _fuzz_text(parser_name: str, rng: random.Random) -> str:
    blocks = {
        "hermes": ["<tool_call>", "</tool_call>", "<tool_", "call>", H(W), H(T), "\n", " ", "hi", "{", "}"],
        "llama3_json": ["<|python_tag|>", "<|py", W, T, ";", "; ", " ", "\n", "text", "{", '"}'],
        "mistral": ["[TOOL_CALLS]", "[TOOL_", "[ARGS]", "[" + W + "]", "get_time", '{"a": 1}', "[", "]", " ", "x", ","],
        "harmony": ["<|channel|>", "<|start|>assistant", "commentary to=functions.get_time ", "final", "analysis",
                    "<|message|>", '{"a": 1}', "<|call|>", "<|end|>", "<|ch", "<|", " ", "x"],
        "deepseek_v3": [DS_BLOCK, DS_BLOCK_END, DS_CALL, DS_CALL_END, DS_SEP, ds_v3(*WEATHER), ds_v31(*TIME),
                        "function", "get_time", "\n```json\n", "```", '{"a": 1}', DS_BLOCK[:5], " ", "x"],
    }[parser_name.removesuffix("1")]
    return "".join(rng.choice(blocks) for _ in range(rng.randint(0, 8)))


@pytest.mark.parametrize("parser_name", sorted(TOOL_PARSERS))
def test_streaming_equals_extract_on_random_texts(parser_name):
    """Random mixes of markers, parts of markers, calls and text, in random pieces."""
    rng = random.Random(parser_name)
    for _ in range(300):
        text = _fuzz_text(parser_name, rng)
        content, calls = get_tool_parser(parser_name).extract(text)
        assert streamed(parser_name, random_split(text, rng)) == (content, calls_of(calls)), text
        assert streamed(parser_name, list(text)) == (content, calls_of(calls)), text


@pytest.mark.parametrize("parser_name, text, released", [
    ("hermes", "Here is a long answer with no call in it", "Here is a long answer with no call in it"),
    ("hermes", "Let me look <tool_", "Let me look"),  # maybe a marker: held, with the space before it
    ("hermes", "Let me look <tool x", "Let me look <tool x"),  # not a marker after all
    ("hermes", "Use the <tool_call> tag", "Use the <tool_call> tag"),  # no JSON after it: not a call
    ("hermes", "Now " + H(W) + " and then more", "Nowand then more"),  # whitespace next to a call goes
    ("llama3_json", "The weather is fine", "The weather is fine"),
    ("mistral", "Checking the forecast [TOOL", "Checking the forecast"),
    ("deepseek_v3", "Let me look " + DS_BLOCK[:4], "Let me look"),
    ("deepseek_v3", "Plain text " + DS_BLOCK[:4] + "x", "Plain text " + DS_BLOCK[:4] + "x"),
])
def test_ordinary_content_is_released_promptly(parser_name, text, released):
    stream = get_tool_parser(parser_name).streaming()
    assert "".join(stream.feed(piece)[0] for piece in text) == released


def test_a_call_is_streamed_as_soon_as_it_is_complete():
    stream = get_tool_parser("hermes").streaming()
    _, deltas = stream.feed("Sure. " + H(W))
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "get_weather", '{"city": "Paris"}')]
    _, deltas = stream.feed("\n" + H(T))
    assert [(d.index, d.name) for d in deltas] == [(1, "get_time")]
    llama = get_tool_parser("llama3_json").streaming()
    assert llama.feed(W + "; " + T[:10])[1][0].name == "get_weather"


def test_call_ids():
    assert re.fullmatch(r"call_[0-9a-f]{24}", new_call_id()) and new_call_id() != new_call_id()
    _, calls = get_tool_parser("hermes").extract(H(W) + H(W))
    assert calls[0].id != calls[1].id and all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
    _, calls = get_tool_parser("mistral").extract("[TOOL_CALLS][" + W + "]")  # Mistral's templates want 9
    assert re.fullmatch(r"[A-Za-z0-9]{9}", calls[0].id)


def test_registry_and_inference():
    assert {name: get_tool_parser(name).name for name in TOOL_PARSERS} == {
        "hermes": "hermes", "llama3_json": "llama3_json", "mistral": "mistral", "harmony": "harmony",
        "deepseek_v3": "deepseek_v3", "deepseek_v31": "deepseek_v31"}
    assert get_tool_parser("mistral").needs_special_tokens and not get_tool_parser("hermes").needs_special_tokens
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_tool_parser("nope")
    qwen = "{% for tool in tools %}...<tool_call>\\n{\"name\": ...}</tool_call>{% endfor %}"
    llama = '{"name": function name, "parameters": dictionary} {% if message.role == "ipython" %}'
    assert infer_tool_parser(qwen) == "hermes"
    assert infer_tool_parser("[AVAILABLE_TOOLS]...[TOOL_CALLS]") == "mistral"
    assert infer_tool_parser(llama) == "llama3_json"
    assert infer_tool_parser("<|python_tag|>") == "llama3_json"
    assert infer_tool_parser(None) is None and infer_tool_parser("{{ messages }}") is None
    assert infer_tool_parser(qwen + "[TOOL_CALLS]") is None  # ambiguous
    v3 = "'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n' + '```json'"
    v31 = "'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + arguments"
    assert infer_tool_parser(v3) == "deepseek_v3" and infer_tool_parser(v31) == "deepseek_v31"
    assert get_tool_parser("deepseek_v3").needs_special_tokens


def test_the_router_side_imports_no_torch():
    code = "import sys, router.tool_parsers, router.reasoning; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ------------------------------------------------------------------ grammars
WEATHER_TOOL = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"], "additionalProperties": False}}
TIME_TOOL = {"name": "get_time", "parameters": None}
TOOLS = [WEATHER_TOOL, TIME_TOOL]


@pytest.fixture(scope="module")
def tokenizers():
    """Qwen-like (the tags are added, not special), Mistral v11-like ([TOOL_CALLS] and [ARGS] special), and
    Mistral v3-like ([TOOL_CALLS] special, no [ARGS]) tokenizers; each with its llguidance backend."""
    from pipeline.builtin_model import build_tokenizer
    from pipeline.structured_output.backend import LLGuidanceBackend

    made = {}
    for kind, added, special in (("plain", ["<tool_call>", "</tool_call>"], []),
                                 ("mistral_v11", [], ["[TOOL_CALLS]", "[ARGS]"]),
                                 ("mistral_v3", [], ["[TOOL_CALLS]"]),
                                 ("deepseek", [], [DS_BLOCK, DS_BLOCK_END, DS_CALL, DS_CALL_END, DS_SEP])):
        tokenizer = build_tokenizer(vocab_size=512)
        tokenizer.add_tokens(added)
        tokenizer.add_tokens(special, special_tokens=True)
        made[kind] = tokenizer, LLGuidanceBackend(tokenizer, len(tokenizer))
    return made


def walk(tokenizer, backend, grammar: str, text: str) -> bool:
    """Whether the grammar takes ``text`` token by token and then ends (EOS taken, or nothing more allowed)."""
    matcher = backend.matcher(StructuredOutput(kind="grammar", value=grammar))
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        if not matcher.accept(token):
            return False
    return matcher.is_finished or (matcher.accept(tokenizer.eos_token_id) and matcher.is_finished)


ONE = {"city": "Paris", "days": 3}
# (parser, tokenizer kind, text of one valid call, of two valid calls, of calls that break the schema)
GRAMMAR_CASES = [
    ("hermes", "plain", H(json.dumps({"name": "get_weather", "arguments": ONE})),
     H(json.dumps({"name": "get_weather", "arguments": ONE})) + "\n" + H('{"name": "get_time", "arguments": {}}'),
     [H(json.dumps({"name": "get_wether", "arguments": ONE})), H('{"name": "get_weather", "arguments": {"days": 3}}'),
      "Sure. " + H(json.dumps({"name": "get_weather", "arguments": ONE})),
      H(json.dumps({"arguments": ONE, "name": "get_weather"}))]),
    ("llama3_json", "plain", json.dumps({"name": "get_weather", "parameters": ONE}),
     json.dumps({"name": "get_weather", "parameters": ONE}) + '; {"name": "get_time", "parameters": {}}',
     ['{"name": "get_weather", "parameters": {"city": 7}}', '{"name": "get_weather", "arguments": {"city": "P"}}',
      '{"name": "get_weather", "parameters": {"city": "P", "extra": 1}}']),
    ("mistral", "mistral_v11", "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(ONE),
     "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(ONE) + "[TOOL_CALLS]get_time[ARGS]{}",
     ["[TOOL_CALLS]get_weather[ARGS]{}", "[TOOL_CALLS]get_weathe[ARGS]" + json.dumps(ONE),
      "get_weather[ARGS]" + json.dumps(ONE)]),
    ("mistral", "mistral_v3", "[TOOL_CALLS]" + json.dumps([{"name": "get_weather", "arguments": ONE}]),
     "[TOOL_CALLS]" + json.dumps([{"name": "get_weather", "arguments": ONE}, {"name": "get_time", "arguments": {}}]),
     ["[TOOL_CALLS]" + json.dumps([{"name": "get_weather", "arguments": {"city": "P", "days": 0}}]),
      "[TOOL_CALLS][]", "[TOOL_CALLS]" + json.dumps({"name": "get_weather", "arguments": ONE})]),
    ("mistral", "plain", "[TOOL_CALLS]" + json.dumps([{"name": "get_weather", "arguments": ONE}]),  # marker as text
     "[TOOL_CALLS]" + json.dumps([{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]),
     ["[TOOL_CALL]" + json.dumps([{"name": "get_weather", "arguments": ONE}])]),
    ("deepseek_v3", "deepseek", DS_BLOCK + ds_v3("get_weather", json.dumps(ONE)) + DS_BLOCK_END,
     DS_BLOCK + ds_v3("get_weather", json.dumps(ONE)) + "\n" + ds_v3("get_time", "{}") + DS_BLOCK_END,
     [DS_BLOCK + ds_v31("get_weather", json.dumps(ONE)) + DS_BLOCK_END,  # the other layout
      DS_BLOCK + ds_v3("get_weather", '{"days": 3}') + DS_BLOCK_END, ds_v3("get_weather", json.dumps(ONE))]),
    ("deepseek_v31", "deepseek", DS_BLOCK + ds_v31("get_weather", json.dumps(ONE)) + DS_BLOCK_END,
     DS_BLOCK + ds_v31("get_weather", json.dumps(ONE)) + ds_v31("get_time", "{}") + DS_BLOCK_END,
     [DS_BLOCK + ds_v31("get_weathr", json.dumps(ONE)) + DS_BLOCK_END,
      DS_BLOCK + ds_v31("get_weather", '{"city": "P", "days": 0}') + DS_BLOCK_END]),
]


@pytest.mark.parametrize("parser_name, kind, one, two, invalid", GRAMMAR_CASES)
def test_call_grammar_takes_a_valid_call_and_refuses_an_invalid_one(tokenizers, parser_name, kind, one, two, invalid):
    tokenizer, backend = tokenizers[kind]
    parser = get_tool_parser(parser_name)
    single = "start: tool_calls\n" + parser.call_grammar(TOOLS, False, tokenizer)
    parallel = "start: tool_calls\n" + parser.call_grammar(TOOLS, True, tokenizer)
    assert walk(tokenizer, backend, single, one) and walk(tokenizer, backend, parallel, one)
    assert walk(tokenizer, backend, parallel, two) and not walk(tokenizer, backend, single, two)
    for text in invalid:
        assert not walk(tokenizer, backend, parallel, text), text
    # what the grammar lets through, the parser reads back as calls that follow their tool's schema
    content, calls = parser.extract(one)
    assert content == "" and calls_of(calls) == [("get_weather", json.dumps(ONE))]
    content, calls = parser.extract(two)
    assert content == "" and len(calls) == 2
    schemas = {tool["name"]: tool["parameters"] or {"type": "object"} for tool in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_grammar_markers_by_special_token_id(tokenizers):
    tokenizer, _ = tokenizers["mistral_v11"]
    grammar = get_tool_parser("mistral").call_grammar([WEATHER_TOOL], False, tokenizer)
    assert f"<[{tokenizer.convert_tokens_to_ids('[TOOL_CALLS]')}]>" in grammar
    assert f"<[{tokenizer.convert_tokens_to_ids('[ARGS]')}]>" in grammar and '"[TOOL_CALLS]"' not in grammar
    plain, _ = tokenizers["plain"]
    assert '"[TOOL_CALLS]"' in get_tool_parser("mistral").call_grammar([WEATHER_TOOL], False, plain)


def test_call_grammar_can_follow_a_reasoning_prefix(tokenizers):
    tokenizer, backend = tokenizers["plain"]
    grammar = 'start: "Thinking done. " tool_calls\n' + get_tool_parser("hermes").call_grammar(TOOLS, False, tokenizer)
    assert walk(tokenizer, backend, grammar, "Thinking done. " + H('{"name": "get_time", "arguments": {}}'))


# What pydantic writes for an Enum and a nested model (the OpenAI SDK's pydantic_function_tool, the Agents SDK's
# function_tool): definitions under $defs, pointed to from the parameters; plus a recursive one (a tree).
REF_TOOLS = [
    {"name": "set_unit", "parameters": {
        "$defs": {"Unit": {"enum": ["C", "F"], "type": "string"},
                  "Place": {"type": "object", "properties": {"city": {"type": "string"},
                                                             "unit": {"$ref": "#/$defs/Unit"}},
                            "required": ["city", "unit"]}},
        "type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}}, "required": ["place"]}},
    {"name": "tree", "parameters": {
        "definitions": {"Unit": {"const": "node"}},  # the same name in another tool, the older keyword
        "type": "object", "properties": {"kind": {"$ref": "#/definitions/Unit"},
                                         "children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["kind"]}},
]
REF_CALLS = ({"name": "set_unit", "arguments": {"place": {"city": "Oslo", "unit": "C"}}},
             {"name": "tree", "arguments": {"kind": "node", "children": [{"kind": "node", "children": []}]}})
REF_INVALID = ({"name": "set_unit", "arguments": {"place": {"city": "Oslo", "unit": "K"}}},
               {"name": "tree", "arguments": {"kind": "node", "children": [{"kind": "leaf"}]}})


@pytest.mark.parametrize("parser_name, kind, layout", [
    ("hermes", "plain", lambda c: H(json.dumps(c))),
    ("llama3_json", "plain", lambda c: json.dumps({"name": c["name"], "parameters": c["arguments"]})),
    ("mistral", "mistral_v3", lambda c: "[TOOL_CALLS]" + json.dumps([c])),
    ("mistral", "mistral_v11", lambda c: f"[TOOL_CALLS]{c['name']}[ARGS]" + json.dumps(c["arguments"])),
    ("deepseek_v3", "deepseek", lambda c: DS_BLOCK + ds_v3(c["name"], json.dumps(c["arguments"])) + DS_BLOCK_END),
])
def test_tool_schemas_with_refs_keep_their_meaning_in_the_call_grammar(tokenizers, parser_name, kind, layout):
    tokenizer, backend = tokenizers[kind]
    grammar = "start: tool_calls\n" + get_tool_parser(parser_name).call_grammar(REF_TOOLS, True, tokenizer)
    for call in REF_CALLS:
        jsonschema.validate(call["arguments"], next(t for t in REF_TOOLS if t["name"] == call["name"])["parameters"])
        assert walk(tokenizer, backend, grammar, layout(call)), call
    for call in REF_INVALID:
        assert not walk(tokenizer, backend, grammar, layout(call)), call
