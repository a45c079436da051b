"""Where a config's values come from, and its errors: a YAML/TOML file section, scalars parsed as JSON,
dicts merged deeply, and pydantic validation errors as one ``ConfigError`` message that names each field."""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Mapping

import yaml
from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    """A configuration value, file or section is invalid; the message names the field."""


def format_validation_error(exc: ValidationError, model: type[BaseModel]) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "<config>"
        msg = err["msg"].removeprefix("Value error, ").removeprefix(f"{field}: ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown field; known fields here: {', '.join(_known_fields(model, err['loc'][:-1]))}"
        elif "input" in err and err["type"] != "missing" and not re.search(r"[(;] got ", msg):  # said already
            msg = f"{msg} (got {err['input']!r})"
        lines.append(f"{field}: {msg}")
    return "invalid config: " + "; ".join(lines)


def _known_fields(model: type[BaseModel], loc: tuple) -> list[str]:
    for part in loc:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            break
        model = annotation
    return sorted(model.model_fields)


def read_config_section(path: str | os.PathLike, section_name: str | None) -> dict[str, Any]:
    """Read a YAML or TOML file and return ``section_name`` (or the whole file when None)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config_file: no such file: {path}")
    text = path.read_text()
    try:
        if path.suffix in (".toml",):
            content = tomllib.loads(text)
        else:
            content = yaml.safe_load(text) or {}
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config_file: {path} is not valid {'TOML' if path.suffix == '.toml' else 'YAML'}: {exc}") from None
    if not isinstance(content, dict):
        raise ConfigError(f"config_file: {path} must hold a mapping at the top level")
    if section_name is None:
        return content
    if section_name not in content or not isinstance(content[section_name], dict):
        raise ConfigError(
            f"section_name: {section_name!r} not found in {path}; sections: {', '.join(sorted(content)) or 'none'}"
        )
    return content[section_name]


def parse_scalar(raw: str) -> Any:
    lowered = raw.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged
