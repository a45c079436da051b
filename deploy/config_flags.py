"""CLI flags generated from PipelineConfig's fields, so flags, files and env vars share one schema.

Top-level fields become ``--field-name``; nested sections become ``--section-field-name``
(``--kv-cache-page-size 4``). ``--model PATH`` is ``model.model_path``. Only flags given on the
command line override the config file and ``TANDEM_*`` environment variables.
"""

from __future__ import annotations

import argparse
import enum
import typing
from typing import Any

from pydantic import BaseModel

from pipeline.config import PipelineConfig, parse_field_value

_SKIP = {"config_file", "section_name", "model"}


def add_config_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Every PipelineConfig field as a flag, but the ``skip`` ones (a launcher sets each process's role)."""
    group = parser.add_argument_group("pipeline config (any PipelineConfig field; see docs/configuration.md)")
    group.add_argument("--config", dest="config_file", default=None, metavar="FILE", help="YAML or TOML config file")
    group.add_argument("--section", dest="section_name", default=None, metavar="NAME",
                       help="section of the config file")
    group.add_argument("--model", dest="cfg:model.model_path", default=argparse.SUPPRESS, metavar="PATH",
                       help="Hugging Face checkpoint directory (default: the built-in random model)")
    group.add_argument("--served-model-name", dest="cfg:model.served_model_name", default=argparse.SUPPRESS,
                       metavar="NAME[,ALIAS...]", help="the names the API serves the model under (vLLM's flag; "
                       "default: the checkpoint folder's name)")
    group.add_argument("--quantization", dest="cfg:model.quantization", default=argparse.SUPPRESS, metavar="{int8}",
                       help=PipelineConfig.model_fields["model"].annotation.model_fields["quantization"].description)
    model_fields = PipelineConfig.model_fields["model"].annotation.model_fields
    group.add_argument("--dtype", dest="cfg:model.dtype", default=argparse.SUPPRESS,
                       metavar="{" + ",".join(typing.get_args(model_fields["dtype"].annotation)) + "}",
                       help=f"{model_fields['dtype'].description} (vLLM's flag; default: auto)")
    for sub_name, sub_field in model_fields.items():  # the rest of the model section: --model-device, --model-seed
        if sub_name not in _MODEL_FLAGS:
            _add(group, f"model-{sub_name}", f"cfg:model.{sub_name}", sub_field)
    for name, field in PipelineConfig.model_fields.items():
        if name in _SKIP or name in skip:
            continue
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            for sub_name, sub_field in annotation.model_fields.items():
                if name == "model" and sub_name in _MODEL_FLAGS:
                    continue
                _add(group, f"{name}-{sub_name}", f"cfg:{name}.{sub_name}", sub_field)
        else:
            _add(group, name, f"cfg:{name}", field)


def _add(group, flag_name: str, dest: str, field) -> None:
    help_text = field.description or ""
    default = field.default if field.default_factory is None else None
    if isinstance(default, enum.Enum):
        default = default.value
    shown = "unset" if default is None else str(default).lower() if isinstance(default, bool) else default
    group.add_argument(
        "--" + flag_name.replace("_", "-"), dest=dest, default=argparse.SUPPRESS, metavar=_metavar(field.annotation),
        help=f"{help_text} (default: {shown})".strip(),
    )


def _metavar(annotation) -> str:
    """What a value looks like: {a,b,c} for a choice, BOOL, INT, FLOAT, else VALUE."""
    options = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    if len(options) == 1 and typing.get_origin(options[0]) is typing.Literal:
        return "{" + ",".join(str(v) for v in typing.get_args(options[0])) + "}"
    if len(options) == 1 and isinstance(options[0], type) and issubclass(options[0], enum.Enum):
        return "{" + ",".join(str(m.value) for m in options[0]) + "}"
    names = {bool: "BOOL", int: "INT", float: "FLOAT", str: "TEXT"}
    kinds = [names.get(option) for option in options]
    return kinds[0] if len(kinds) == 1 and kinds[0] else "VALUE"


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The nested override dict of the config flags that were given."""
    overrides: dict[str, Any] = {}
    for dest, raw in vars(args).items():
        if not dest.startswith("cfg:"):
            continue
        path = dest[4:].split(".")
        node = overrides
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = parse_field_value(path, raw)
    return overrides


def override_flags(overrides: dict[str, Any]) -> list[str]:
    """``config_overrides``' inverse: a nested override dict as the flags that set it
    (``{"router": {"prefill_spill_tokens": 2048}}`` -> ``["--router-prefill-spill-tokens", "2048"]``); the model
    section's by vLLM's names (``--model``, ``--served-model-name``, ``--quantization``, ``--dtype``), the rest
    as ``--model-FIELD``."""
    flags: list[str] = []
    for name, value in overrides.items():
        for sub_name, sub_value in (value.items() if isinstance(value, dict) else [(None, value)]):
            if name == "model" and sub_name in _MODEL_FLAGS:
                flag = _MODEL_FLAGS[sub_name]
            else:
                flag = "--" + (name if sub_name is None else f"{name}-{sub_name}").replace("_", "-")
            flags += [flag, str(sub_value)]
    return flags


_MODEL_FLAGS = {"model_path": "--model", "served_model_name": "--served-model-name", "quantization": "--quantization",
                "dtype": "--dtype"}


def config_from_args(args: argparse.Namespace, **extra: Any) -> PipelineConfig:
    overrides = config_overrides(args)
    overrides.update(extra)
    return PipelineConfig.load(args.config_file, args.section_name, overrides=overrides)
