"""Torch reference: the GELU-gated MLP's activation, GELU-tanh(gate) * up over a fused gate/up projection (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
    # transformers' "gelu_pytorch_tanh" is torch's tanh approximation, in the activations' dtype
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
