"""One output constraint for a chat answer: the request's own (``response_format``, vLLM's fields), a forced
tool call, or under ``tool_choice`` auto either of the first and the calls, placed after the thinking when the
model reasons.

Without reasoning a constraint is used as given. With a reasoning parser the thinking must stay free,
so the constraint is rewritten as one llguidance Lark grammar ``start: <thinking> <constraint>``:
a JSON schema becomes ``%json``, a regex a terminal, choices literals, a forced call the tool parser's
rules. A user's own Lark grammar cannot be spliced in (its rules could clash with ours): that is a 400.
"""

from __future__ import annotations

import json

from pipeline.protocol import StructuredOutput
from pipeline.structured_output.closed_objects import closed_objects
from router.errors import bad_request

_BACKEND = "llguidance"  # composed grammars use its Lark extensions (%json, lazy terminals)
# JSON as the backend writes a schema alone: no free whitespace (a model could spend its budget on blank lines)
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def combined_constraint(requested: StructuredOutput | None, call_grammar: tuple[str, str] | None,
                        thinking_prefix: str | None,
                        calls_instead: tuple[str, str] | None = None) -> StructuredOutput | None:
    """The one constraint of the answer. ``call_grammar``: the tools' (rules, entry rule), when a call is forced
    or strict tools are offered; ``thinking_prefix``: the reasoning parser's Lark sequence for the thinking
    (None: no reasoning); ``calls_instead``: under ``tool_choice`` auto, the calls (rules, entry rule) the
    answer may be instead of ``requested``."""
    if requested is not None and calls_instead is not None:
        call_rules, call_entry = calls_instead
        why = "tools under tool_choice auto (their calls are the other answer)"
        if thinking_prefix:
            why = f"the reasoning parser (its thinking comes first) nor with {why}"
        return StructuredOutput(kind="grammar", backend=_BACKEND, value=(
            f"start: {thinking_prefix or ''} answer_or_calls\nanswer_or_calls: answer | {call_entry}\n"
            f"{_answer_rule(requested, why)}\n{call_rules}"))
    if requested is not None and call_grammar is not None:
        raise bad_request("tool_choice: the tools' call grammar (a required or named call, or strict tools) already "
                          "constrains the answer; drop response_format / structured_outputs, or use tool_choice "
                          "auto (and, beside structured_outputs, tools that are not strict)", param="tool_choice")
    if call_grammar is not None:
        rules, entry = call_grammar
        return StructuredOutput(kind="grammar", value=f"start: {thinking_prefix or ''} {entry}\n{rules}",
                                backend=_BACKEND)
    if requested is None or not thinking_prefix:
        return requested
    answer = _answer_rule(requested, "the reasoning parser (its thinking comes first)")
    return StructuredOutput(kind="grammar", value=f"start: {thinking_prefix} answer\n{answer}", backend=_BACKEND)


def _answer_rule(spec: StructuredOutput, combined_with: str) -> str:
    """The answer's Lark rule; ``combined_with``: what the constraint is spliced beside (a grammar cannot be)."""
    if spec.kind == "json":
        return f"answer: %json {_schema_object(spec.value)}"
    if spec.kind == "json_object":
        return "answer: %json " + json.dumps({"type": "object", **_COMPACT})
    if spec.kind == "regex":
        return "answer: ANSWER\nANSWER: /" + _slashes_escaped(spec.value) + "/"
    if spec.kind == "choice":
        return "answer: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choices)
    thinking_off = ", or send chat_template_kwargs to turn thinking off" if "reasoning" in combined_with else ""
    raise bad_request(f"structured_outputs.grammar: a grammar cannot be combined with {combined_with}; use a JSON "
                      f"schema, regex or choice{thinking_off}", param="structured_outputs")


def _slashes_escaped(regex: str) -> str:
    """``regex`` inside a Lark ``/.../`` literal: each ``/`` not escaped already gets its backslash (``\\/``, which
    clients write in closing tags, stays as it is)."""
    out, i = [], 0
    while i < len(regex):
        if regex[i] == "\\":
            out.append(regex[i:i + 2])
            i += 2
            continue
        out.append("\\/" if regex[i] == "/" else regex[i])
        i += 1
    return "".join(out)


def _schema_object(text: str) -> str:
    schema = json.loads(text)
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise bad_request("response_format: the schema must be a JSON object", param="response_format")
    return json.dumps({**_COMPACT, **closed_objects(schema)})
