"""Torch references: RMSNorm (optionally fused with the residual add) and rotary embedding.

Both follow Hugging Face's Llama numerics exactly (fp32 accumulation, weight applied after casting
back), so the CPU path is token-exact with transformers.
"""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Return ``norm(x)``, or ``(norm(x + residual), x + residual)`` when a residual is given."""
    if residual is not None:
        x = x + residual
        residual = x
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    out = weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)
    return out if residual is None else (out, residual)


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0) -> torch.Tensor:
    """[max_positions, rotary_dim] with cos in the first half and sin in the second, fp32."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]  # [max_positions, rotary_dim / 2]
    return torch.cat((freqs.cos() * attention_scaling, freqs.sin() * attention_scaling), dim=-1)


def apply_rotary_ref(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim] (cos | sin halves)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding over the whole head dim, as in HF Llama."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [num_tokens, head_dim / 2] each
    cos = torch.cat((cos, cos), dim=-1)[:, None, :]  # [num_tokens, 1, head_dim]
    sin = torch.cat((sin, sin), dim=-1)[:, None, :]
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
