"""Reads a Hugging Face checkpoint directory: its config, its safetensors weights (sharded or not), the model.

Every way a directory can fail to be a usable checkpoint ends in one ``CheckpointError`` that names
the path or tensor at fault, before any half-loaded model is handed out.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import torch

from pipeline.checkpoint_errors import CheckpointError
from pipeline.checkpoint_files import checkpoint_directory, weight_files
from pipeline.models.registry import resolve_model_class
from pipeline.quantization.loading import plan_quantization

__all__ = ["CheckpointError", "load_hf_config", "weight_files", "iter_safetensors", "load_model",
           "checkpoint_fingerprint"]

def load_hf_config(path: str | os.PathLike):
    """The transformers config of the checkpoint at ``path`` (local directory only, no remote code)."""
    directory = checkpoint_directory(path)
    from transformers import AutoConfig  # heavy import, only where a config is read

    try:
        return AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers raises many types for a broken config; all mean the same here
        raise CheckpointError(f"cannot read the model config {directory / 'config.json'}: {exc}") from exc


def open_weight_files(path: str | os.PathLike) -> Iterator:
    """Yield each weight file of the checkpoint opened with safetensors (memory-mapped, on the CPU), one at a
    time and closed after; a file that cannot be read is a ``CheckpointError`` naming it."""
    from safetensors import safe_open

    for file in weight_files(path):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # SafetensorError for a corrupt header, OSError for an unreadable file
            raise CheckpointError(f"cannot read weight file {file}: {exc}") from exc
        with handle:
            yield handle


def iter_safetensors(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, cpu tensor)`` for every tensor of the checkpoint, one file at a time (memory-mapped)."""
    for handle in open_weight_files(path):
        for name in handle.keys():
            yield name, handle.get_tensor(name)


def load_model(path: str | os.PathLike, dtype: torch.dtype, device: str | torch.device,
               quantization: str | None = None):
    """Build the model for the checkpoint at ``path`` directly on ``device`` in ``dtype``; returns ``(model, hf_config)``.

    Weights stored in another dtype (e.g. bf16 on disk, fp32 asked) are cast while they are copied in. A
    quantized checkpoint, or ``quantization`` ("int8": W8A8 at load), goes through ``pipeline.quantization``.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (got {dtype!r})")
    hf_config = load_hf_config(path)
    model_class = resolve_model_class(hf_config)
    weight_files(path)  # fail on missing weights before allocating anything
    model = model_class(hf_config, dtype=dtype, device=device)
    load_checkpoint_weights(model, path, iter_safetensors(path), quantization)
    return model.eval(), hf_config


def load_checkpoint_weights(model: torch.nn.Module, path: str | os.PathLike,
                            tensors: Iterator[tuple[str, torch.Tensor]], quantization: str | None) -> None:
    """Fill ``model`` from ``tensors`` (the checkpoint's at ``path``, or a tensor-parallel rank's slices of them):
    quantized layers are swapped in first where the checkpoint (or ``quantization``) says so, and laid out for
    their GEMMs once every tensor is in (``pipeline.quantization``)."""
    plan = plan_quantization(model, path, quantization)  # None: nothing quantized
    model.load_weights(tensors if plan is None else plan.tensors(tensors))
    if plan is not None:
        plan.finish(model)


def checkpoint_fingerprint(path: str | os.PathLike) -> str:
    """A short stable id of a checkpoint (its config plus each weight file's name and size), used by
    prefill and decode workers to refuse to exchange KV computed by different models."""
    import hashlib

    path = Path(path)
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in weight_files(path):
        digest.update(f"{file.name}:{file.stat().st_size}".encode())
    return digest.hexdigest()[:16]
