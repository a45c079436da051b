"""Torch reference: the gated MLP's activation, SiLU(gate) * up over a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
