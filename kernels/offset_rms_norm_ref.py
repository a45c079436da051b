"""Torch reference: RMSNorm whose weight is stored as an offset from one (Gemma), optionally fused with the residual add.

Gemma scales by ``1 + weight`` and multiplies in fp32 before casting back (Llama casts first, then
multiplies in the activations' dtype), so this is its own op: in bf16 the two round differently.
"""

from __future__ import annotations

import torch


def offset_rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden], the offset from one
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Return ``norm(x)``, or ``(norm(x + residual), x + residual)`` when a residual is given."""
    if residual is not None:
        x = x + residual  # in the activations' dtype, as transformers adds the residual
        residual = x
    x32 = x.float()
    out = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)
    return out if residual is None else (out, residual)
