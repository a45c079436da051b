"""What xgrammar would not enforce is refused by name (it used to answer 200 "stop" with output breaking the
schema); ``json_object`` on xgrammar is an object; a GBNF grammar works on the default backend (llguidance)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from pipeline.protocol import StructuredOutput
from pipeline.structured_output.xgrammar_schemas import unenforced_keyword

needs_xgrammar = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None,
                                    reason="pip install 'tandem[xgrammar]'")
OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# each: a schema using a keyword xgrammar does not enforce, and a document that breaks only that keyword
UNENFORCED = {
    "allOf": ({"allOf": [OBJECT, {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
              "123"),
    "not": ({"type": "integer", "not": {"const": 3}}, "3"),
    "if": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, '{"a":1}'),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a":1}'),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]"),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]"),
    "minLength": ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}, '"abcdefgh"'),
    "ipv4": ({"type": "string", "format": "ipv4"}, '"070.070.92.39"'),
}


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def backends(tokenizer):
    from pipeline.structured_output.backend import make_backend

    made = {name: make_backend(name, tokenizer, len(tokenizer)) for name in ("llguidance", "xgrammar")
            if name == "llguidance" or importlib.util.find_spec("xgrammar") is not None}
    return made.__getitem__


def _xgrammar_takes(compiled, document: str, tokenizer) -> bool:
    """Whether xgrammar's matcher takes ``document`` whole, as a complete answer."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiled)
    return matcher.accept_string(document) and (matcher.is_terminated() or matcher.accept_token(tokenizer.eos_token_id))


def test_the_keywords_are_found_where_they_are_and_names_are_not_keywords():
    for name, (schema, _) in UNENFORCED.items():
        assert name in unenforced_keyword({"type": "object", "properties": {"x": schema}}), name
    assert "#/$defs/p/items" in unenforced_keyword({"$defs": {"p": {"type": "array", "items": UNENFORCED["not"][0]}}})
    named = {"type": "object", "properties": {"not": {"type": "integer"}, "allOf": {"type": "string"}},
             "required": ["not", "allOf"]}  # properties named like keywords, and enum data
    assert unenforced_keyword(named) is None
    assert unenforced_keyword({"enum": [{"allOf": 1}], "anyOf": [OBJECT, {"type": "string", "pattern": "a"}]}) is None


@needs_xgrammar
@pytest.mark.parametrize("name", list(UNENFORCED))
def test_xgrammar_takes_what_breaks_each_keyword_so_it_is_refused_by_name(backends, tokenizer, name):
    """The first assertion is why the keyword is refused: should a new xgrammar enforce it, it fails, and the
    keyword can leave the list."""
    from pipeline.structured_output.backend import StructuredOutputError

    schema, breaking = UNENFORCED[name]
    backend = backends("xgrammar")
    compiled = backend._compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    assert _xgrammar_takes(compiled, breaking, tokenizer)
    with pytest.raises(StructuredOutputError, match=f"does not enforce .*{name}.*llguidance"):
        backend.validate(StructuredOutput(kind="json", value=json.dumps(schema), backend="xgrammar"))


@needs_xgrammar
def test_the_router_refuses_them_without_torch_too(tokenizer):
    from pipeline.structured_output.backend import BackendSet, StructuredOutputError
    from router.structured_output import _check_without_torch

    spec = StructuredOutput(kind="json", value=json.dumps(UNENFORCED["allOf"][0]), backend="xgrammar")
    with pytest.raises(StructuredOutputError, match="'allOf' at #"):
        _check_without_torch(spec, BackendSet(tokenizer, len(tokenizer)))


@needs_xgrammar
def test_json_object_on_xgrammar_is_an_object_with_any_values(backends, tokenizer):
    compiled, _ = backends("xgrammar")._compile(StructuredOutput(kind="json_object", backend="xgrammar"))
    for document in ("[1]", "5", '"x"', "true"):  # the built-in JSON grammar it used took all of these
        assert not _xgrammar_takes(compiled, document, tokenizer), document
    for document in ('{"a":[1,{"b":null}],"c":"d"}', "{}", '{"a": 1}'):
        assert _xgrammar_takes(compiled, document, tokenizer), document


def test_a_gbnf_grammar_runs_on_the_default_backend(backends, tokenizer):
    """vLLM's own guided_grammar example (llama.cpp's GBNF), which llguidance's Lark parser refused."""
    gbnf = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""
    matcher = backends("llguidance").matcher(StructuredOutput(kind="grammar", value=gbnf))
    tokens = tokenizer.encode("SELECT col_1  from table_2  where col_2 = 1 ", add_special_tokens=False)
    assert all(matcher.accept(t) for t in tokens) and matcher.is_finished
