"""Quantized weights back to floats: ``weight * scale`` per tensor, per output channel or per 2-D block.

What a layer that does not run quantized gets at load: every fp8 layer on the CPU (no fp8 GEMM here; the
checkpoint's fp8 values times their scale are exact in fp32 and bf16 adds one rounding), weight-only int8 or
fp8 checkpoints, a quantized ``lm_head``, the experts of a mixture-of-experts layer and its router.
Both compressed-tensors' ``weight_scale`` and the fp8 method's ``weight_scale_inv`` multiply (the latter's
name notwithstanding: DeepSeek-V3's reference dequantizes with ``weight * scale_inv``).

compressed-tensors ``pack-quantized`` (W4A16, W8A16): ``dequantize_packed`` unpacks the int32 words (value j of a
row at bits ``j * num_bits`` onward of the row's little-endian bit stream, stored plus ``1 << (num_bits - 1)``:
compressed-tensors' ``pack_to_int32``) and multiplies by the scale of its group of input columns or its output
channel. Symmetric only (no zero point): ``(value - 0) * scale``, exact in fp32 (a 4- or 8-bit integer times a
bf16 / fp16 / fp32 scale).
"""

from __future__ import annotations

import torch

from pipeline.checkpoint_errors import CheckpointError
from pipeline.quantization.checks import check_scale_shape, packed_layout_problem
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


def unpack_int32(packed: torch.Tensor, num_bits: int, cols: int) -> torch.Tensor:
    """int32 ``[rows, ceil(cols * num_bits / 32)]`` -> the signed integers ``[rows, cols]`` (int32), as
    compressed-tensors' ``unpack_from_int32`` gives them (``num_bits`` 4 or 8: no value straddles two words)."""
    per_word = 32 // num_bits
    shifts = torch.arange(per_word, dtype=torch.int32, device=packed.device) * num_bits
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)  # [rows, words, per_word], unsigned
    return fields.reshape(packed.shape[0], -1)[:, :cols] - (1 << (num_bits - 1))


def dequantize_packed(prefix: str, packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor,
                      spec: QuantizationSpec) -> torch.Tensor:
    """fp32 ``[out, in]`` from a pack-quantized layer's ``weight_packed``, ``weight_scale`` and ``weight_shape``
    (``[out, in]``); ``CheckpointError`` naming the tensor whose dtype or shape does not fit ``spec``."""
    if packed.dtype != torch.int32:
        raise CheckpointError(f"{prefix}.weight_packed is {packed.dtype}: pack-quantized weights are int32 words")
    if shape.dim() != 1 or shape.numel() != 2 or shape.dtype.is_floating_point:
        raise CheckpointError(f"{prefix}.weight_shape has shape {tuple(shape.shape)} ({shape.dtype}): expected two "
                              "integers [out, in]")
    rows, cols = (int(value) for value in shape.tolist())
    problem = packed_layout_problem(prefix, tuple(packed.shape), tuple(scale.shape), (rows, cols), spec)
    if problem:
        raise CheckpointError(problem)
    values, scale = unpack_int32(packed, spec.num_bits, cols).float(), scale.float()
    if spec.weight_strategy == "channel":
        return values * scale.reshape(rows, 1)
    return values * scale.repeat_interleave(spec.group_size, 1)[:, :cols]  # the last group may be partial
