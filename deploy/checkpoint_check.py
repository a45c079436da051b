"""The launchers' check of a checkpoint before any process starts: a directory Tandem cannot serve
(no config.json, an architecture no model class implements, a quantization format it cannot run, quantized
weights or scales that do not match what the config declares, missing weight files, a draft model that
cannot serve beside it) is one clear error in a few seconds, not a router and workers that start, load and crash
one after another."""

from __future__ import annotations


def check_checkpoint(model_path: str | None) -> dict | None:
    """Raise ``CheckpointError`` (a ValueError) naming what is wrong with ``model_path``; None (the
    built-in model) is always fine. Reads files only (no torch, no transformers: the fork server loads
    those once, for the workers), so the launcher starts nothing later for it. Returns its config.json."""
    if model_path is None:
        return None
    from pipeline.checkpoint_files import read_config_json, weight_files
    from pipeline.models.registry import supported_architecture
    from pipeline.quantization.checks import check_quantized_checkpoint
    from pipeline.quantization.config import quantization_spec

    config = read_config_json(model_path)
    supported_architecture(list(config.get("architectures") or []))
    quantization_spec(config)
    weight_files(model_path)
    check_quantized_checkpoint(model_path)  # the stored dtypes and scale shapes against what the config declares
    return config


def check_checkpoints(config) -> None:
    """``check_checkpoint`` on the model of ``config`` (a PipelineConfig) and, when it speculates with a draft
    checkpoint, on the draft too, which must also cover every position the target serves."""
    target = check_checkpoint(config.model.model_path)
    draft_path = config.draft_model.model_path
    if not config.is_speculative or draft_path is None or target is None:
        return
    from pipeline.checkpoint_errors import CheckpointError
    from pipeline.checkpoint_files import max_positions
    from pipeline.speculative.draft_context import check_draft_covers

    try:
        draft = check_checkpoint(draft_path)
    except CheckpointError as exc:
        raise CheckpointError(f"draft_model.model_path: {exc}") from None
    target_positions = max_positions(target)  # None: the class default, which the engine checks once loaded
    if target_positions is not None:
        max_length = min(config.max_length or target_positions, target_positions)
        check_draft_covers(draft_path, max_positions(draft), max_length)
