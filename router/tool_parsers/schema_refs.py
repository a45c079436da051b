"""A tool's parameters schema moved inside a larger schema without breaking its ``$ref`` pointers.

A tool's ``parameters`` is a JSON schema of its own: ``{"$defs": {"Unit": ...}, "properties": {"unit": {"$ref":
"#/$defs/Unit"}}}`` is what pydantic (and so the OpenAI SDK's ``pydantic_function_tool`` and the Agents SDK's
``function_tool``) writes for an Enum or a nested model. A call grammar nests it under a call object (``{"name":
..., "arguments": <parameters>}``), sometimes beside other tools' parameters, where ``#`` is no longer the tool's
root. ``hoist_definitions`` moves the tool's definitions out under names of its own and rewrites every local
pointer to them, so the composed schema carries them at its root (``$defs``) and each resolves as in the tool's
own schema, recursion included.
"""

from __future__ import annotations

from typing import Any

_DEFINITION_MAPS = ("$defs", "definitions")


def hoist_definitions(parameters: dict, prefix: str, into: dict[str, Any]) -> dict:
    """``parameters`` without its definitions, its local ``$ref``s pointing to ``#/$defs/<prefix><name>``; the
    definitions (rewritten the same way) are added to ``into``. A pointer into the tool's root itself (``#`` or
    ``#/properties/...``) gets the root as a definition of its own, ``<prefix>root``."""
    if not _has_local_refs(parameters):
        return parameters
    root_name = f"{prefix}root"
    needs_root = False

    def rewrite(node: Any) -> Any:
        nonlocal needs_root
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {key: rewrite(value) for key, value in node.items()
               if key not in _DEFINITION_MAPS or node is not parameters}  # the root's move out
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            parts = ref[2:].split("/", 1) if ref != "#" else [""]
            if parts[0] in _DEFINITION_MAPS and len(parts) == 2:
                name, _, rest = parts[1].partition("/")
                out["$ref"] = f"#/$defs/{prefix}{name}" + (f"/{rest}" if rest else "")
            else:
                needs_root = True
                out["$ref"] = f"#/$defs/{root_name}" + (f"/{ref[2:]}" if ref != "#" else "")
        return out

    body = rewrite(parameters)
    for key in _DEFINITION_MAPS:
        for name, definition in (parameters.get(key) or {}).items():
            into[f"{prefix}{name}"] = rewrite(definition)
    if needs_root:
        into[root_name] = body
    return body


def _has_local_refs(node: Any) -> bool:
    if isinstance(node, dict):
        ref = node.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(_has_local_refs(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_local_refs(item) for item in node)
    return False
