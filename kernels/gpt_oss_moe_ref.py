"""Torch reference: gpt-oss's experts over tokens grouped by expert, with biases and the clamped SwiGLU.

The rows are grouped exactly as ``kernels/moe_ref.py`` groups them (sorted by expert, one GEMM pair per
expert over its contiguous rows, each row's output scaled by its routing weight and summed back into its
token); what differs is the expert's arithmetic, transformers' ``GptOssExperts``: biased projections and
``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=limit)``. The
gate/up rows are stored gate block first, up block second (de-interleaved once at load).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.moe_ref import combine_rows, sort_rows_by_expert


def clamped_swiglu_ref(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``[rows, 2 * intermediate]`` (gate | up) -> ``[rows, intermediate]``, transformers' ``_apply_gate``."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def clamped_swiglu_moe_ref(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    gate_up: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: gate rows, then up rows
    gate_up_bias: torch.Tensor,  # [num_experts, 2 * intermediate]
    down: torch.Tensor,  # [num_experts, hidden, intermediate]
    down_bias: torch.Tensor,  # [num_experts, hidden]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] routing weights
    topk_ids: torch.Tensor,  # [num_tokens, top_k] expert of each choice
    alpha: float,
    limit: float,
) -> torch.Tensor:  # [num_tokens, hidden]
    num_tokens, top_k = topk_ids.shape
    order, rows_per_expert = sort_rows_by_expert(topk_ids, gate_up.shape[0])
    grouped = hidden[order // top_k]  # [num_rows, hidden]: each expert's rows contiguous
    grouped_out = torch.empty_like(grouped)  # [num_rows, hidden]
    start = 0
    for expert, count in enumerate(rows_per_expert.tolist()):  # one GEMM pair per expert, none per token
        if count:
            rows = grouped[start : start + count]  # [count, hidden]
            projected = F.linear(rows, gate_up[expert], gate_up_bias[expert])  # [count, 2 * intermediate]
            activated = clamped_swiglu_ref(projected, alpha, limit)  # [count, intermediate]
            grouped_out[start : start + count] = F.linear(activated, down[expert], down_bias[expert])
        start += count
    row_outputs = torch.empty_like(grouped_out)
    row_outputs[order] = grouped_out  # back to row order: token t's choices at rows t * top_k ...
    return combine_rows(row_outputs, topk_weights, hidden.dtype)
