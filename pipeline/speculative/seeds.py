"""Per-position generators: a seeded request's draw at each output position depends only on its seed and that
position, and it is the plain sampler's own draw there (``step_execution.plan_seeds`` seeds the request's
generator with ``step_seed(seed, position)`` before each sampled token). The draft proposes from that same noise
and the verifier samples the target from it (``rejection_sampler``, the coupled path), so a seeded request emits
the tokens it would emit without speculation, alone or batched, however its prompt was chunked and wherever a
speculation window began."""

from __future__ import annotations

import torch

from pipeline.sampler import step_seed


def position_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    """The generator the plain sampler draws output position ``position`` of a request seeded with ``seed`` from."""
    generator = torch.Generator(device=device)
    generator.manual_seed(step_seed(seed, position))
    return generator
