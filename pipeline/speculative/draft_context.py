"""Whether a draft covers the positions it will draft at (torch-free: the launchers check it before any process
starts, the engine again when it loads the draft).

A draft drafts at every position the target serves, up to the engine's ``max_length``; its rotary tables end at
its own ``max_position_embeddings``. A shorter draft is refused, not run past its end (an IndexError in a step on
the torch kernels, a read past the table on the native ones).
"""

from __future__ import annotations

from pipeline.config import ConfigError


def check_draft_covers(draft_path: str, draft_positions: int | None, max_length: int) -> None:
    """``ConfigError`` naming both limits when the draft's ``draft_positions`` (its max_position_embeddings; None:
    unknown, not checked) is under ``max_length``, the positions the target serves."""
    if draft_positions is None or draft_positions >= max_length:
        return
    raise ConfigError(
        f"draft_model.model_path: {draft_path} covers {draft_positions} positions (its max_position_embeddings) "
        f"but the target serves up to {max_length} (max_length); the draft drafts at every position: set "
        f"max_length to {draft_positions} or less, or use a draft whose context is {max_length} or more")
