"""A checkpoint's ``generation_config.json``: the EOS ids and sampling defaults its authors recommend.

Read as plain JSON (the router never imports torch). EOS ids listed there always end generation, as
they do in transformers' ``generate``; the sampling defaults (temperature, top_p, top_k, min_p,
repetition_penalty, and max_new_tokens as max_tokens) fill what a request leaves unset unless
``sampling.generation_config`` is "ignore" (vLLM's ``--generation-config vllm``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_config(model_dir: str | Path | None) -> dict[str, Any]:
    """The file's contents, or {} when the checkpoint has none (or it is not a JSON object)."""
    if model_dir is None:
        return {}
    path = Path(model_dir) / "generation_config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def generation_eos_ids(generation_config: dict[str, Any]) -> set[int]:
    eos = generation_config.get("eos_token_id")
    if isinstance(eos, int):
        return {eos}
    if isinstance(eos, list):
        return {int(i) for i in eos if isinstance(i, int)}
    return set()


def sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams field -> the checkpoint's recommended default (only the keys it sets)."""
    return {field: generation_config[key] for key, field in SAMPLING_KEYS.items()
            if isinstance(generation_config.get(key), (int, float)) and not isinstance(generation_config[key], bool)}


def resolved_defaults(sampling_config, generation_config: dict[str, Any], *, serving: bool = False) -> dict[str, Any]:
    """What a request that leaves a parameter unset gets: a value the operator set in the ``sampling``
    section, else the checkpoint's (unless ``generation_config`` is "ignore"), else the section's default.
    ``serving``: the API's default output length is the rest of the context (``max_tokens`` None), as
    in vLLM and OpenAI, unless the operator or the checkpoint set one."""
    values = {"temperature": sampling_config.temperature, "top_p": sampling_config.top_p,
              "top_k": sampling_config.top_k, "min_p": 0.0, "repetition_penalty": 1.0,
              "max_tokens": sampling_config.max_tokens}
    if serving and "max_tokens" not in sampling_config.model_fields_set:
        values["max_tokens"] = None
    if sampling_config.generation_config == "auto":
        for field, value in sampling_defaults(generation_config).items():
            if field not in sampling_config.model_fields_set:
                values[field] = int(value) if field in ("top_k", "max_tokens") else float(value)
    return values
