"""Draft checkpoints made from a target checkpoint: its first N layers (a truncated-layer copy, which
agrees with the target often: the benchmark's high-acceptance pair) or an always-wrong copy; and the
benchmark's way to make a random target refine in its late layers (``scale_late_layers``)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline.weights import iter_safetensors, load_hf_config

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_RESIDUAL_OUT = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn\.o_proj|mlp\.down_proj)\.weight$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def truncated_copy(target: str | Path, draft: str | Path, num_layers: int) -> Path:
    """Write ``target``'s first ``num_layers`` decoder layers (with its embeddings, final norm and head) to ``draft``."""
    config = load_hf_config(target)
    if not 1 <= num_layers <= config.num_hidden_layers:
        raise ValueError(f"num_layers must be in 1..{config.num_hidden_layers} (got {num_layers})")
    weights = {name: tensor.contiguous() for name, tensor in iter_safetensors(target)
               if (match := _LAYER.search(name)) is None or int(match.group(1)) < num_layers}
    changes = {"num_hidden_layers": num_layers}
    if isinstance(getattr(config, "layer_types", None), list):  # per-layer attention kinds (Qwen3, ...)
        changes["layer_types"] = config.layer_types[:num_layers]
    return _write(target, draft, weights, **changes)


def always_wrong_copy(target: str | Path, draft: str | Path) -> Path:
    """``target`` with zero embeddings and head: every logit is 0, so it always proposes token 0."""
    weights = {name: (torch.zeros_like(tensor) if "embed_tokens" in name or "lm_head" in name else tensor).contiguous()
               for name, tensor in iter_safetensors(target)}
    return _write(target, draft, weights)


def scale_late_layers(path: Path, scale: float, first_scaled: int = 1) -> int:
    """Multiply the residual-stream outputs (o_proj, down_proj) of layers >= ``first_scaled`` by ``scale``
    in place; returns how many tensors changed."""
    from pipeline.weights import weight_files

    files = weight_files(path)
    if len(files) != 1:
        raise SystemExit(f"{path}: expected one safetensors file, found {len(files)}")
    weights, num_scaled = {}, 0
    for name, tensor in iter_safetensors(path):
        match = _RESIDUAL_OUT.search(name)
        if match is not None and int(match.group(1)) >= first_scaled:
            tensor, num_scaled = tensor * scale, num_scaled + 1
        weights[name] = tensor.contiguous()
    save_file(weights, str(files[0]), metadata={"format": "pt"})
    return num_scaled


def _write(target: str | Path, draft: str | Path, weights: dict[str, torch.Tensor], **config_changes) -> Path:
    target, draft = Path(target), Path(draft)
    draft.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config.update(config_changes)
    (draft / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(draft / "model.safetensors"), metadata={"format": "pt"})
    for name in _TOKENIZER_FILES:
        if (target / name).exists():
            shutil.copy(target / name, draft / name)
    return draft
