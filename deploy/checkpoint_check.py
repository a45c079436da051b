"""The launchers' check of a checkpoint before any process starts: a directory Tandem cannot serve
(no config.json, an architecture no model class implements, missing weight files) is one clear error
in a few seconds, not a router and workers that start, load and crash one after another."""

from __future__ import annotations


def check_checkpoint(model_path: str | None) -> None:
    """Raise ``CheckpointError`` (a ValueError) naming what is wrong with ``model_path``; None (the
    built-in model) is always fine."""
    if model_path is None:
        return
    from pipeline.models.registry import resolve_model_class
    from pipeline.weights import load_hf_config, weight_files

    resolve_model_class(load_hf_config(model_path))  # "unsupported architecture X; supported: ..."
    weight_files(model_path)
