"""The launchers' check of a checkpoint before any process starts: a directory Tandem cannot serve
(no config.json, an architecture no model class implements, a quantization format it cannot run, quantized
weights or scales that do not match what the config declares, missing weight files, a draft model that
cannot serve beside it) is one clear error in a few seconds, not a router and workers that start, load and crash
one after another."""

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


def check_checkpoints(config) -> None:
    """``check_checkpoint`` on the model of ``config`` (a PipelineConfig) and, when it speculates with a draft
    checkpoint, on the draft too, which must also cover every position the target serves."""
    check_checkpoint(config.model.model_path)
    draft_path = config.draft_model.model_path
    if not config.is_speculative or draft_path is None or config.model.model_path is None:
        return
    from pipeline.checkpoint_errors import CheckpointError
    from pipeline.checkpoint_files import read_config_json
    from pipeline.speculative.draft_context import check_draft_covers

    try:
        check_checkpoint(draft_path)
    except CheckpointError as exc:
        raise CheckpointError(f"draft_model.model_path: {exc}") from None
    target_positions = _max_positions(read_config_json(config.model.model_path))
    if target_positions is not None:
        max_length = min(config.max_length or target_positions, target_positions)
        check_draft_covers(draft_path, _max_positions(read_config_json(draft_path)), max_length)


def _max_positions(config: dict) -> int | None:
    """max_position_embeddings as config.json states it (a multimodal wrapper's in its text_config); None when it
    does not (transformers' class default applies: the engine checks the loaded config)."""
    value = config.get("max_position_embeddings", (config.get("text_config") or {}).get("max_position_embeddings"))
    return value if isinstance(value, int) else None
