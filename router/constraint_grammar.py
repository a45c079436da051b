"""One output constraint for a chat answer: the request's own (``response_format``, vLLM's fields) or a
forced tool call, placed after the thinking when the model reasons.

Without reasoning a constraint is used as given. With a reasoning parser the thinking must stay free,
so the constraint is rewritten as one llguidance Lark grammar ``start: <thinking> <constraint>``:
a JSON schema becomes ``%json``, a regex a terminal, choices literals, a forced call the tool parser's
rules. A user's own Lark grammar cannot be spliced in (its rules could clash with ours): that is a 400.
"""

from __future__ import annotations

import json

from pipeline.protocol import StructuredOutput
from router.errors import bad_request

_BACKEND = "llguidance"  # composed grammars use its Lark extensions (%json, lazy terminals)
# JSON as the backend writes a schema alone: no free whitespace (a model could spend its budget on blank lines)
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def combined_constraint(requested: StructuredOutput | None, call_grammar: tuple[str, str] | None,
                        thinking_prefix: str | None) -> StructuredOutput | None:
    """The one constraint of the answer. ``call_grammar``: the tools' (rules, entry rule), when a call is forced
    or strict tools are offered; ``thinking_prefix``: the reasoning parser's Lark sequence for the thinking
    (None: no reasoning)."""
    if requested is not None and call_grammar is not None:
        raise bad_request("tool_choice: a required or named tool call, or strict tools, already constrain the "
                          "answer; drop response_format / structured_outputs", param="tool_choice")
    if call_grammar is not None:
        rules, entry = call_grammar
        return StructuredOutput(kind="grammar", value=f"start: {thinking_prefix or ''} {entry}\n{rules}",
                                backend=_BACKEND)
    if requested is None or not thinking_prefix:
        return requested
    return StructuredOutput(kind="grammar", value=f"start: {thinking_prefix} answer\n{_answer_rule(requested)}",
                            backend=_BACKEND)


def _answer_rule(spec: StructuredOutput) -> str:
    if spec.kind == "json":
        return f"answer: %json {_schema_object(spec.value)}"
    if spec.kind == "json_object":
        return "answer: %json " + json.dumps({"type": "object", **_COMPACT})
    if spec.kind == "regex":
        return "answer: ANSWER\nANSWER: /" + spec.value.replace("/", "\\/") + "/"
    if spec.kind == "choice":
        return "answer: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choices)
    raise bad_request("structured_outputs.grammar: a grammar cannot be combined with the reasoning parser (its "
                      "thinking comes first); use a JSON schema, regex or choice, or send "
                      "chat_template_kwargs to turn thinking off", param="structured_outputs")


def _schema_object(text: str) -> str:
    schema = json.loads(text)
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise bad_request("response_format: the schema must be a JSON object", param="response_format")
    return json.dumps({**_COMPACT, **schema})
