"""JSON-schema objects closed to undeclared properties, as vLLM's default grammar backend reads them.

A JSON schema allows any property it does not declare unless it says ``additionalProperties: false``. vLLM's
default backend (xgrammar, strict mode) reads a schema as closed instead, and so does Tandem's xgrammar backend:
an object holds the properties its schema lists and nothing else. llguidance follows the JSON Schema default, so
a model it constrains may go on writing invented keys (a random or weak model does, until ``max_tokens``), and the
same request would answer differently on the two backends. ``closed_objects`` gives llguidance the closed reading:
every object schema that lists ``properties`` and says nothing about other keys gets ``additionalProperties:
false``. A schema that wants open objects says ``additionalProperties: true`` (or gives ``patternProperties``).
Branches of ``allOf`` are left open: each lists only its share of the properties.
"""

from __future__ import annotations

from typing import Any

_SAYS_WHICH_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalItems", "not", "if", "then", "else", "contains", "additionalProperties")


def closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` whose objects that list properties allow no others unless they say so."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    if "properties" in closed and not any(key in closed for key in _SAYS_WHICH_KEYS):
        closed["additionalProperties"] = False
    for key in _SUBSCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(sub) for name, sub in closed[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_objects(sub) for sub in closed[key]]
    for key in _SUBSCHEMAS:
        if isinstance(closed.get(key), dict):
            closed[key] = closed_objects(closed[key])
    return closed
