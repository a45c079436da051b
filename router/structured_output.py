"""Structured-output fields of a request body -> a validated ``StructuredOutput``, or a 400 naming the problem.

Accepted, as OpenAI and vLLM clients send them:

* ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``, or
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``;
* vLLM's ``structured_outputs``: ``{"json": schema | str, "regex": str, "choice": [str], "grammar": str,
  "json_object": true, "backend": "llguidance"}`` (exactly one constraint), and the older
  ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields.

The constraint is compiled here, once per distinct constraint (the grammar backend caches it), so a bad
schema or grammar never reaches a worker.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from pipeline.protocol import StructuredOutput
from router.errors import bad_request
from router.openai_schema import ResponseFormat
from router.served_model import ServedModel

_BACKENDS: dict[int, Any] = {}  # id(ServedModel) -> its grammar BackendSet (the tokenizer is wrapped once)


GUIDED_KINDS = ("json", "regex", "choice", "grammar")  # vLLM's guided_<kind> request fields


def structured_output_from(body: Any) -> StructuredOutput | None:
    """The body's one constraint (None when it has none); 400 for a malformed or doubled one."""
    found: list[tuple[str, StructuredOutput]] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        spec = _from_response_format(response_format)
        if spec is not None:
            found.append(("response_format", spec))
    extension = {key: (f"structured_outputs.{key}", value)
                 for key, value in (getattr(body, "structured_outputs", None) or {}).items()}
    for name in GUIDED_KINDS:  # vLLM's older guided_* fields, named as the client sent them
        value = getattr(body, f"guided_{name}", None)
        if value is not None:
            extension.setdefault(name, (f"guided_{name}", value))
    backend = extension.pop("backend", (None, None))[1]
    for key, (param, value) in extension.items():
        found.append((param, _from_extension(key, value, backend, param)))
    if len(found) > 1:
        raise bad_request(f"give one output constraint, not {len(found)} ({', '.join(n for n, _ in found)})",
                          param=found[1][0])
    return found[0][1] if found else None


def constraint_param(body: Any) -> str:
    """The request field a 400 about the step's constraint names: the client's own constraint when it set one,
    else ``tools`` (the constraint is the call grammar of ``tool_choice`` required or named)."""
    if getattr(body, "response_format", None) is not None:
        return "response_format"
    if getattr(body, "structured_outputs", None):
        return "structured_outputs"
    for name in GUIDED_KINDS:  # vLLM's older fields, named as the client sent them
        if getattr(body, f"guided_{name}", None) is not None:
            return f"guided_{name}"
    return "tools" if getattr(body, "tools", None) else "response_format"


def is_a_response_format(body: Any) -> bool:
    """Whether the body's constraint is OpenAI's ``response_format`` (a format for the final answer, which tool
    calls under ``tool_choice`` auto may replace) rather than vLLM's ``structured_outputs`` (a constraint on
    the whole text, calls included, as vLLM applies it)."""
    response_format = getattr(body, "response_format", None)
    return response_format is not None and _from_response_format(response_format) is not None


def _from_response_format(value: ResponseFormat) -> StructuredOutput | None:
    """(Its fields validated by ``openai_schema.ResponseFormat``: an unknown one is a 400 naming it.)"""
    if value.type == "json_object":
        return StructuredOutput(kind="json_object")
    if value.type == "json_schema":
        if value.json_schema is None:
            raise bad_request("response_format.json_schema: must be an object with a 'schema'",
                              param="response_format.json_schema")
        return StructuredOutput(kind="json", value=json.dumps(value.json_schema.schema_))
    return None  # text


def _from_extension(key: str, value: Any, backend: Any, param: str) -> StructuredOutput:
    if backend is not None and not isinstance(backend, str):
        raise bad_request("structured_outputs.backend: must be a string", param="structured_outputs.backend")
    try:
        if key == "json":
            return StructuredOutput(kind="json", value=value if isinstance(value, str) else json.dumps(value),
                                    backend=backend)
        if key == "json_object":
            return StructuredOutput(kind="json_object", backend=backend)
        if key == "choice":
            if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
                raise bad_request(f"{param}: must be a list of strings", param=param)
            return StructuredOutput(kind="choice", choices=value, backend=backend)
        if key in ("regex", "grammar"):
            if not isinstance(value, str):
                raise bad_request(f"{param}: must be a string", param=param)
            return StructuredOutput(kind=key, value=value, backend=backend)
    except ValueError as exc:
        raise bad_request(f"{param}: {exc}", param=param) from None
    raise bad_request(f"structured_outputs: unknown constraint {key!r} (json, json_object, regex, choice, grammar)",
                      param="structured_outputs")


def check_structured_output(spec: StructuredOutput, model: ServedModel, default_backend: str | None,
                            param: str = "response_format") -> StructuredOutput:
    """Compile ``spec`` against the served model's tokenizer with its backend (the configured default when
    it names none, which is then written into it, so every worker uses the backend that validated it);
    a 400 naming the problem if it cannot be used."""
    from pipeline.structured_output.backend import BackendSet, StructuredOutputError, check_backend_name

    try:
        backends = _BACKENDS.get(id(model))
        if backends is None:
            backends = _BACKENDS[id(model)] = BackendSet(model.tokenizer, model.vocab_size, default_backend)
        spec.backend = check_backend_name(spec.backend or backends.default)
        if spec.backend == "xgrammar" and sys.modules.get("torch", 0) is None:
            _check_without_torch(spec, backends)
        else:
            backends.validate(spec)
    except StructuredOutputError as exc:
        raise bad_request(f"{param}: {exc}", param=param) from None
    return spec


def _check_without_torch(spec: StructuredOutput, backends) -> None:
    """xgrammar needs torch, which the router keeps out of its process: check the constraint with
    llguidance's compiler instead (a GBNF grammar translated to Lark). That is the stricter of the
    two (xgrammar ignores schema keywords llguidance refuses); the worker compiles it with xgrammar."""
    from llguidance.gbnf_to_lark import gbnf_to_lark

    from pipeline.structured_output.backend import StructuredOutputError
    from pipeline.structured_output.xgrammar_schemas import refusal as xgrammar_refusal

    check = spec
    if spec.kind == "json":
        try:
            why = xgrammar_refusal(json.loads(spec.value))
        except ValueError:  # not JSON: llguidance's check below says so
            why = None
        if why:
            raise StructuredOutputError(why)
    if spec.kind == "grammar":
        try:
            check = StructuredOutput(kind="grammar", value=gbnf_to_lark(spec.value))
        except Exception as exc:  # noqa: BLE001 - the translator's own errors name the bad rule
            raise StructuredOutputError(f"grammar: {str(exc).strip() or exc!r}") from None
    backends.get("llguidance").validate(check)

