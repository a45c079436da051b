"""Quantized weights back to floats: ``weight * scale`` per tensor, per output channel or per 2-D block.

What a layer that does not run quantized gets at load: every fp8 layer on the CPU (no fp8 GEMM here; the
checkpoint's fp8 values times their scale are exact in fp32 and bf16 adds one rounding), weight-only int8 or
fp8 checkpoints, a quantized ``lm_head``, the experts of a mixture-of-experts layer and its router.
Both compressed-tensors' ``weight_scale`` and the fp8 method's ``weight_scale_inv`` multiply (the latter's
name notwithstanding: DeepSeek-V3's reference dequantizes with ``weight * scale_inv``).
"""

from __future__ import annotations

import math

import torch

from pipeline.checkpoint_errors import CheckpointError


def dequantize_weight(name: str, weight: torch.Tensor, scale: torch.Tensor,
                      block_size: tuple[int, int] | None) -> torch.Tensor:
    """fp32 ``[out, in]`` from a quantized ``[out, in]`` weight and its scale: one value (per tensor),
    ``[out]`` / ``[out, 1]`` (per channel) or ``[ceil(out / b0), ceil(in / b1)]`` (per block)."""
    values, scale = weight.float(), scale.float()
    rows, cols = values.shape
    if scale.numel() == 1:
        return values * scale.reshape(())
    if scale.numel() == rows and (scale.dim() == 1 or scale.shape[-1] == 1):
        return values * scale.reshape(rows, 1)
    if scale.dim() == 2:
        block_rows, block_cols = block_size or (math.ceil(rows / scale.shape[0]), math.ceil(cols / scale.shape[1]))
        if (math.ceil(rows / block_rows), math.ceil(cols / block_cols)) == tuple(scale.shape):
            expanded = scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
            return values * expanded
    raise CheckpointError(f"{name}: scale of shape {tuple(scale.shape)} fits neither a per-tensor, per-channel nor "
                          f"{block_size or ''} block layout of the weight {tuple(weight.shape)}")
