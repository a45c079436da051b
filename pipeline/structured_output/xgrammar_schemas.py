"""The JSON-schema keywords xgrammar compiles but does not enforce, so that a request relying on one is refused
by name instead of answered with output that breaks its schema.

Measured on xgrammar 0.2.8 (each keyword with a document that violates only it: xgrammar's matcher accepted it):
``allOf``, ``not``, ``if`` / ``then`` / ``else``, ``dependentRequired``, ``dependentSchemas``, ``uniqueItems``,
``contains`` (and ``minContains`` / ``maxContains``), ``minLength`` / ``maxLength`` beside a ``pattern`` (the
pattern alone is kept), and ``format: ipv4`` (leading zeros pass). Everything else the fuzz tests use is
enforced (``anyOf``, ``oneOf``, ``$ref``, enums, bounds, ``pattern``, lengths, other formats, item counts,
``propertyNames``, ``patternProperties``). llguidance, the default backend, enforces or refuses each of them.

Torch-free: the router checks with it too (``router/structured_output.py``).
"""

from __future__ import annotations

from typing import Any

UNENFORCED = ("allOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "uniqueItems",
              "contains", "minContains", "maxContains")
UNENFORCED_FORMATS = ("ipv4",)
_NAMED_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_DATA = ("const", "enum", "default", "examples", "required")  # values, not schemas


def unenforced_keyword(schema: Any, path: str = "#") -> str | None:
    """The first keyword of ``schema`` (with where it is) that xgrammar would not enforce; None when there is
    none."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            found = unenforced_keyword(item, f"{path}/{i}")
            if found:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    for key in UNENFORCED:
        if key in schema and schema[key] is not False:
            return f"'{key}' at {path}"
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        return f"'minLength' / 'maxLength' beside 'pattern' at {path}"
    if schema.get("format") in UNENFORCED_FORMATS:
        return f"'format: {schema['format']}' at {path}"
    for key, value in schema.items():
        if key in _DATA:
            continue
        if key in _NAMED_SUBSCHEMAS and isinstance(value, dict):
            for name, subschema in value.items():
                found = unenforced_keyword(subschema, f"{path}/{key}/{name}")
                if found:
                    return found
        elif isinstance(value, (dict, list)):
            found = unenforced_keyword(value, f"{path}/{key}")
            if found:
                return found
    return None


def refusal(schema: Any) -> str | None:
    """Why xgrammar cannot take ``schema`` (the message of a 400), or None."""
    found = unenforced_keyword(schema)
    if found is None:
        return None
    return (f"json: the xgrammar backend does not enforce {found}; use the llguidance backend (the default), "
            f"or drop the keyword")
