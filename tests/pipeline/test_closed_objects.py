"""``closed_objects``: JSON-schema objects closed to undeclared keys (xgrammar's strict reading), and through the
llguidance backend a constrained answer holds no invented key."""

from __future__ import annotations

import json

import pytest

from pipeline.structured_output.closed_objects import closed_objects


def test_objects_that_list_properties_are_closed_unless_they_say_otherwise():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "open": {"type": "object", "properties": {"c": {}}, "additionalProperties": True},
        "patterned": {"type": "object", "properties": {}, "patternProperties": {"^x": {}}},
        "list": {"type": "array", "items": {"type": "object", "properties": {"d": {}}}},
        "either": {"anyOf": [{"type": "object", "properties": {"e": {}}}, {"type": "string"}]},
        "ref": {"$ref": "#/$defs/thing"}},
        "$defs": {"thing": {"type": "object", "properties": {"f": {}}}},
        "allOf_kept_open": {"allOf": [{"type": "object", "properties": {"g": {}}}]}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["a"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert "additionalProperties" not in props["patterned"]
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["thing"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["allOf_kept_open"]["allOf"][0]
    assert "additionalProperties" not in schema["properties"]["a"]  # a copy: the caller's schema is unchanged
    assert closed_objects(True) is True and closed_objects({"type": "string"}) == {"type": "string"}


def test_the_llguidance_backend_refuses_an_invented_key():
    pytest.importorskip("llguidance")
    from pipeline.builtin_model import build_tokenizer
    from pipeline.protocol import StructuredOutput
    from pipeline.structured_output.backend import LLGuidanceBackend

    tokenizer = build_tokenizer(vocab_size=400)
    backend = LLGuidanceBackend(tokenizer, len(tokenizer))
    spec = StructuredOutput(kind="json", value=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                            "required": ["a"]}))

    def accepts(text: str) -> bool:
        matcher = backend.matcher(spec)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return all(matcher.accept(t) for t in ids) and matcher.accept(tokenizer.eos_token_id)
    assert accepts('{"a":1}')
    assert not accepts('{"a":1,"b":2}')
