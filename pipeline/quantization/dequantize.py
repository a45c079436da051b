"""Quantized weights back to floats: ``weight * scale`` per tensor, per output channel or per 2-D block.

What a layer that does not run quantized gets at load: every fp8 layer on the CPU (no fp8 GEMM here; the
checkpoint's fp8 values times their scale are exact in fp32 and bf16 adds one rounding), weight-only int8 or
fp8 checkpoints, a quantized ``lm_head``, the experts of a mixture-of-experts layer and its router.
Both compressed-tensors' ``weight_scale`` and the fp8 method's ``weight_scale_inv`` multiply (the latter's
name notwithstanding: DeepSeek-V3's reference dequantizes with ``weight * scale_inv``).
"""

from __future__ import annotations

import torch

from pipeline.checkpoint_errors import CheckpointError
from pipeline.quantization.checks import check_scale_shape
from pipeline.quantization.config import QuantizationSpec


def dequantize_weight(name: str, weight: torch.Tensor, scale_name: str, scale: torch.Tensor,
                      spec: QuantizationSpec) -> torch.Tensor:
    """fp32 ``[out, in]`` from a quantized ``[out, in]`` weight and its scale, laid out as ``spec``'s declared
    strategy says: one value (tensor), ``[out]`` / ``[out, 1]`` (channel) or ``[ceil(out / bh), ceil(in / bw)]``
    (block); a scale of another shape is a ``CheckpointError`` naming it (never a layout guessed from its shape)."""
    if weight.dim() != 2:
        raise CheckpointError(f"{name}: a quantized weight of shape {tuple(weight.shape)} (expected [out, in])")
    check_scale_shape(scale_name, tuple(scale.shape), tuple(weight.shape), spec)
    values, scale = weight.float(), scale.float()
    rows, cols = values.shape
    if spec.weight_strategy == "tensor":
        return values * scale.reshape(())
    if spec.weight_strategy == "channel":
        return values * scale.reshape(rows, 1)
    block_rows, block_cols = spec.block_size
    expanded = scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    return values * expanded
