"""Per-position generators: a seeded request's speculative draws depend only on its seed and the output
position they decide, so it samples the same tokens alone or batched, whatever was accepted before."""

from __future__ import annotations

import torch

from pipeline.sampler import step_seed

# Independent streams per position: drafting a token and verifying it must not share draws.
DRAFT_STREAM = 1
VERIFY_STREAM = 2


def position_generator(seed: int, position: int, stream: int, device: torch.device) -> torch.Generator:
    """A generator for output position ``position`` of a request seeded with ``seed``, on ``device``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(step_seed(seed + stream * 1_000_000_007, position))
    return generator
