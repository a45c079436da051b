"""A checkpoint directory's files, read without torch or transformers: its config.json as plain JSON and the
safetensors files holding its weights. What a launcher checks before it starts anything, cheaply."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline.checkpoint_errors import CheckpointError

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


def checkpoint_directory(path: str | os.PathLike) -> Path:
    """``path`` as a checkpoint directory: it exists, is a directory and holds a config.json."""
    directory = Path(path)
    if not directory.exists():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint path {directory} is not a directory")
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory} is not a Hugging Face checkpoint: it has no config.json")
    return directory


def read_config_json(path: str | os.PathLike) -> dict:
    """The checkpoint's config.json as a dict (no transformers: the workers read it through AutoConfig)."""
    config_path = checkpoint_directory(path) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read the model config {config_path}: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"cannot read the model config {config_path}: not a JSON object")
    return config


def max_positions(config: dict) -> int | None:
    """max_position_embeddings as a config.json states it (a multimodal wrapper's in its text_config); None when it
    does not (transformers' class default then applies)."""
    value = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return value if isinstance(value, int) else None


def stated_dtype(config: dict) -> str | None:
    """The dtype a config.json states for the weights (``dtype``, or ``torch_dtype`` as older transformers wrote
    it; a multimodal wrapper's in its text_config), e.g. ``"bfloat16"``; None when it states none."""
    for section in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = section.get(key)
            if isinstance(value, str):
                return value.removeprefix("torch.")
    return None


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files holding the checkpoint's weights, checked to exist."""
    directory = Path(path)
    single, index = directory / SINGLE_FILE, directory / SHARD_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"cannot read the shard index {index}: {exc!r}") from exc
        files = [directory / name for name in names]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"weight shard {file} listed in {index} is missing")
        return files
    if single.is_file():
        return [single]
    hint = ""
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
        hint = " (PyTorch .bin/.pt weights are not supported; convert the checkpoint to safetensors)"
    raise CheckpointError(f"no weights in {directory}: expected {SINGLE_FILE} or {SHARD_INDEX} with its shards{hint}")
