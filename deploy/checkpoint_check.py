"""The launchers' check of a checkpoint before any process starts: a directory Tandem cannot serve
(no config.json, an architecture no model class implements, a quantization format it cannot run, quantized
weights or scales that do not match what the config declares, missing weight files) is one clear error in a few seconds, not a router and workers that start, load and crash one
after another."""

from __future__ import annotations


def check_checkpoint(model_path: str | None) -> None:
    """Raise ``CheckpointError`` (a ValueError) naming what is wrong with ``model_path``; None (the
    built-in model) is always fine. Reads files only (no torch, no transformers: the fork server loads
    those once, for the workers), so the launcher starts nothing later for it."""
    if model_path is None:
        return
    from pipeline.checkpoint_files import read_config_json, weight_files
    from pipeline.models.registry import supported_architecture
    from pipeline.quantization.checks import check_quantized_checkpoint
    from pipeline.quantization.config import quantization_spec

    config = read_config_json(model_path)
    supported_architecture(list(config.get("architectures") or []))
    quantization_spec(config)
    weight_files(model_path)
    check_quantized_checkpoint(model_path)  # the stored dtypes and scale shapes against what the config declares
