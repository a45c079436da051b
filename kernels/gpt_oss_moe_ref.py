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

from kernels.moe_ref import experts_over_grouped_rows


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
    def expert(index: int, rows: torch.Tensor) -> torch.Tensor:  # [count, hidden] -> [count, hidden]
        return clamped_swiglu_expert(rows, gate_up[index], gate_up_bias[index], down[index], down_bias[index], alpha,
                                     limit)

    return experts_over_grouped_rows(hidden, topk_weights, topk_ids, gate_up.shape[0], expert)


def clamped_swiglu_expert(rows: torch.Tensor, gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor,
                          down_bias: torch.Tensor, alpha: float, limit: float,
                          activation=clamped_swiglu_ref) -> torch.Tensor:
    """One expert over its rows ``[count, hidden]`` -> ``[count, hidden]``: biased gate/up, the clamped SwiGLU
    (``activation``: ``clamped_swiglu_ref``'s contract), biased down."""
    projected = F.linear(rows, gate_up, gate_up_bias)  # [count, 2 * intermediate]
    return F.linear(activation(projected, alpha, limit), down, down_bias)
