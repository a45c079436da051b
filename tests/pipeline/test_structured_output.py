"""Structured output in the engine, fuzzed with a random-weight model: its logits are near uniform, so the
grammar does all the work. Every output must parse strictly and validate against its schema."""

from __future__ import annotations

import importlib.util
import json
import re

import jsonschema
import pytest
import torch

from pipeline import LLM, SamplingParams
from pipeline.protocol import StructuredOutput
from pipeline.request_validation import RequestError

pytest.importorskip("llguidance")
BACKENDS = ["llguidance", pytest.param("xgrammar", marks=pytest.mark.skipif(
    importlib.util.find_spec("xgrammar") is None, reason="pip install 'tandem[xgrammar]'"))]
GRAMMARS = {"llguidance": 'start: "a" ("b" | "c")+ "d"\n', "xgrammar": 'root ::= "a" ("b" | "c")+ "d"'}

SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "ok"], "properties": {
        "user": {"type": "object", "additionalProperties": False, "required": ["name", "age"], "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
        "ok": {"type": "boolean"}}},
    "array_enum": {"type": "object", "additionalProperties": False, "required": ["tags"], "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4}}},
    "numbers_optional": {"type": "object", "additionalProperties": False, "required": ["x"], "properties": {
        # a free "number" may take digits forever under a random model; these are bounded
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "ratio": {"type": "number", "enum": [0.5, 1.25]},
        "note": {"type": "string", "maxLength": 5},
        "count": {"type": "integer", "minimum": 1, "maximum": 9}}},
    "ref": {"type": "object", "additionalProperties": False, "required": ["a", "b"], "$defs": {
        "point": {"type": "object", "additionalProperties": False, "required": ["x", "y"], "properties": {
            "x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": {"type": "integer", "minimum": 0, "maximum": 99}}}},
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}},
}


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint("llama"), kv_cache={"page_size": 4, "num_blocks": 512})


def constrained(spec: StructuredOutput, temperature: float, seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=300, temperature=temperature, seed=seed, structured_output=spec)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_parses_and_validates(llm, name, temperature, backend):
    schema = SCHEMAS[name]
    spec = StructuredOutput(kind="json", value=json.dumps(schema), backend=backend)
    prompts = ["Tell me", "A", "{", "The quick brown fox"]
    outputs = llm.generate(prompts, [constrained(spec, temperature, seed=i) for i in range(len(prompts))])
    for out in outputs:
        assert out.finish_reason == "stop", (out.text, out.finish_reason)
        jsonschema.validate(json.loads(out.text), schema)  # strict json.loads: no trailing text allowed
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_total_blocks


@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_choice_and_grammar(llm, backend):
    outputs = llm.generate(["x"] * 4, [
        constrained(StructuredOutput(kind="regex", value=r"[0-9]{3}-[a-z]{2,4}", backend=backend), 1.0, seed=2),
        constrained(StructuredOutput(kind="choice", choices=["yes", "no", "not sure"], backend=backend), 1.0, seed=3),
        constrained(StructuredOutput(kind="choice", choices=["yes", "no", "not sure"], backend=backend), 0.0),
        constrained(StructuredOutput(kind="grammar", value=GRAMMARS[backend], backend=backend), 0.0),
    ])
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outputs[0].text)
    assert outputs[1].text in ("yes", "no", "not sure") and outputs[2].text in ("yes", "no", "not sure")
    assert re.fullmatch(r"a[bc]+d", outputs[3].text) or outputs[3].finish_reason == "length"
    assert all(o.finish_reason == "stop" for o in outputs[:3])
    # the grammar complete on the last token max_tokens allows: a whole answer, "stop" (not "length")
    choice = StructuredOutput(kind="choice", choices=["yes"], backend=backend)
    exact = SamplingParams(max_tokens=len(llm.tokenizer.encode("yes", add_special_tokens=False)), temperature=0.0,
                           structured_output=choice)
    at_limit = llm.generate(["x"], exact)[0]
    assert at_limit.text == "yes" and at_limit.finish_reason == "stop"


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_conforming_document_is_allowed_token_by_token(llm, backend_name):
    """No false rejections: every token of a valid document is in the mask when it comes."""
    from pipeline.structured_output.backend import make_backend

    engine = llm.engine
    schema = SCHEMAS["nested"]
    document = json.dumps({"user": {"name": "ab", "age": 42}, "ok": True}, separators=(",", ":"))
    backend = make_backend(backend_name, engine.tokenizer, engine.vocab_size)
    matcher = backend.matcher(StructuredOutput(kind="json", value=json.dumps(schema)))
    bitmask = torch.zeros(1, -(-engine.vocab_size // 32), dtype=torch.int32)
    for token in engine.tokenizer.encode(document, add_special_tokens=False):
        matcher.fill_bitmask(bitmask, 0)
        assert (int(bitmask[0, token // 32]) >> (token % 32)) & 1, f"token {token} rejected"
        assert matcher.accept(token)
    matcher.fill_bitmask(bitmask, 0)
    assert any(int(bitmask[0, t // 32]) >> (t % 32) & 1 for t in engine.eos_token_ids) or matcher.is_finished
    # any JSON object, for {"type": "json_object"}
    matcher = backend.matcher(StructuredOutput(kind="json_object"))
    for token in engine.tokenizer.encode('{"a":[1,2.5,{"b":null}],"c":"d"}', add_special_tokens=False):
        matcher.fill_bitmask(bitmask, 0)
        assert (int(bitmask[0, token // 32]) >> (token % 32)) & 1 and matcher.accept(token)


def test_seeded_constrained_request_is_the_same_alone_batched_and_with_overlap(tiny_checkpoint, llm):
    spec = StructuredOutput(kind="json", value=json.dumps(SCHEMAS["array_enum"]))
    alone = llm.generate(["Tell me"], constrained(spec, 1.0, seed=7))[0]
    batched = llm.generate(["other", "Tell me", "more"], constrained(spec, 1.0, seed=7))[1]
    overlap = LLM(model=tiny_checkpoint("llama"), kv_cache={"page_size": 4, "num_blocks": 512},
                  enable_overlap_scheduler=True)
    overlapped = overlap.generate(["Tell me"], constrained(spec, 1.0, seed=7))[0]
    assert alone.token_ids == batched.token_ids == overlapped.token_ids


@pytest.mark.parametrize("spec, message", [
    (StructuredOutput(kind="json", value="{not json"), "not valid JSON"),
    (StructuredOutput(kind="regex", value="[a-z"), "regex"),
    (StructuredOutput(kind="grammar", value="start: undefined_rule"), "undefined_rule"),
    (StructuredOutput(kind="json", value='{"type": "object"}', backend="nope"), "unknown backend"),
    (StructuredOutput(kind="json", value='{"type": "object", "not": {"required": ["a"]}}'), "Unimplemented keys"),
    (StructuredOutput(kind="grammar", value="root ::= undefined", backend="xgrammar"), "undefined"),
    (StructuredOutput(kind="json", value='{"type": "bogus"}', backend="xgrammar"), "bogus"),
    # a constraint nothing satisfies: llguidance answered "" as a success, xgrammar failed on a token it refused
    (StructuredOutput(kind="regex", value=r"[^\s\S]"), "nothing can satisfy it"),
    (StructuredOutput(kind="regex", value=r"x[^\s\S]"), "nothing can satisfy it"),
    (StructuredOutput(kind="regex", value=r"[^\s\S]", backend="xgrammar"), "nothing can satisfy it"),
])
def test_bad_constraints_are_request_errors_and_nothing_leaks(llm, spec, message):
    free = llm.engine.kv_manager.num_free_blocks
    with pytest.raises(RequestError, match=message):
        llm.generate(["x"], constrained(spec, 0.0))
    assert llm.engine.kv_manager.num_free_blocks == free and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlap_keeps_constrained_batches_overlapping_and_identical(tiny_checkpoint, llm, backend):
    """With overlap on, a constrained step is launched before the previous one is read; its masks are
    filled after the grammars take those tokens. Same tokens as overlap off, every output valid."""
    overlap = LLM(model=tiny_checkpoint("llama"), kv_cache={"page_size": 4, "num_blocks": 512},
                  enable_overlap_scheduler=True)
    drained = []
    original = overlap.engine._read
    overlap.engine._read = lambda step: (drained.append(step.needs_host_tokens), original(step))[1]
    prompts = ["Tell me", "A", "{", "The quick brown fox"]
    for name, schema in SCHEMAS.items():
        params = [constrained(StructuredOutput(kind="json", value=json.dumps(schema), backend=backend), 1.0, seed=i)
                  for i in range(len(prompts))]
        on, off = overlap.generate(prompts, params), llm.generate(prompts, params)
        assert [o.token_ids for o in on] == [o.token_ids for o in off], name
        for out in on:
            jsonschema.validate(json.loads(out.text), schema)
    assert drained and not any(drained)  # no step had to be read before the next was launched


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_an_added_token_in_the_forced_text_keeps_the_constraint(tmp_path, tiny_checkpoint, backend):
    """A non-special added token (Qwen's ``<tool_call>``) inside forced text: llguidance's own loader
    made it special yet tokenized text into it, so its mask allowed a token its matcher refused, and the
    request ended early as a success (regex "x<tool_call>y" gave "x<tool_call>" with finish "stop")."""
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path / "with-added-token"
    shutil.copytree(tiny_checkpoint("llama"), path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<tool_call>"])  # id 300: inside the model's padded vocabulary (307)
    tokenizer.save_pretrained(path)
    llm = LLM(model=str(path), kv_cache={"page_size": 4, "num_blocks": 128})
    added = tokenizer.convert_tokens_to_ids("<tool_call>")
    regex = StructuredOutput(kind="regex", value="x<tool_call>y", backend=backend)
    schema = {"type": "object", "properties": {"a": {"const": "<tool_call>"}}, "required": ["a"],
              "additionalProperties": False}
    const = StructuredOutput(kind="json", value=json.dumps(schema), backend=backend)
    for spec, want in ((regex, "x<tool_call>y"), (const, '{"a":"<tool_call>"}')):
        for temperature, bias in ((0.0, {}), (1.0, {added: 50.0})):  # also when the model wants the added token
            out = llm.generate(["Hi"], SamplingParams(max_tokens=40, temperature=temperature, seed=1,
                                                      logit_bias=bias, structured_output=spec))[0]
            assert out.text == want and out.finish_reason == "stop", (backend, out.text, out.finish_reason)


def test_a_refused_token_ends_the_request_as_an_error(llm, monkeypatch):
    """Whatever the backend: a token the matcher refuses never ends a request as "stop"."""
    make = llm.engine._grammar_matcher

    def refusing(params):
        matcher = make(params)
        accept = matcher.accept
        calls = []

        def accept_then_refuse(token_id):
            calls.append(token_id)
            return accept(token_id) and len(calls) < 2

        matcher.accept = accept_then_refuse
        return matcher

    monkeypatch.setattr(llm.engine, "_grammar_matcher", refusing)
    free = llm.engine.kv_manager.num_free_blocks
    spec = StructuredOutput(kind="regex", value="[a-z]{10}")
    out = llm.generate(["Hi"], SamplingParams(max_tokens=20, temperature=0.0, structured_output=spec))[0]
    assert out.finish_reason == "error" and len(out.token_ids) == 2
    assert llm.engine.kv_manager.num_free_blocks == free
