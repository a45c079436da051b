"""Torch reference: the experts of a mixture-of-experts MLP over tokens grouped by expert (vLLM's fused_moe idea).

Each token's ``top_k`` (expert, weight) choices become ``top_k`` rows. The rows are sorted by expert, so
each expert runs one GEMM over its contiguous run of rows (gate/up, SiLU(gate) * up, down) instead of one
small product per token; each row's output, scaled by its routing weight, is then summed back into its
token. The triton kernel (``kernels/triton_moe.py``) groups rows the same way; this is its oracle.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kernels.activation_ref import silu_and_mul_ref


def sort_rows_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_ids [num_tokens, top_k]`` -> (row ids ``[num_tokens * top_k]`` in expert order, rows per expert ``[num_experts]``).

    Row ``r`` is token ``r // top_k``'s choice ``r % top_k``; the sort is stable, so a run keeps token order.
    """
    flat = topk_ids.reshape(-1)  # [num_rows]
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


def combine_rows(row_outputs: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows back into tokens: ``[num_tokens * top_k, hidden]`` (row order) -> ``[num_tokens, hidden]``.

    Each row is scaled by its routing weight and a token's rows are summed in fp32 (or wider), then cast.
    """
    num_tokens, top_k = topk_weights.shape
    weighted = row_outputs.view(num_tokens, top_k, -1) * topk_weights.unsqueeze(-1)  # [num_tokens, top_k, hidden]
    return weighted.sum(dim=1, dtype=torch.promote_types(weighted.dtype, torch.float32)).to(dtype)


def experts_over_grouped_rows(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] routing weights
    topk_ids: torch.Tensor,  # [num_tokens, top_k] expert of each choice
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],  # (expert id, its rows [count, hidden]) -> [count, hidden]
) -> torch.Tensor:  # [num_tokens, hidden]
    """The grouping every MoE reference shares: rows sorted by expert, ``expert`` applied once per expert to
    its contiguous run (one GEMM pair per expert, none per token), rows back in order, combined per token."""
    top_k = topk_ids.shape[1]
    order, rows_per_expert = sort_rows_by_expert(topk_ids, num_experts)
    grouped = hidden[order // top_k]  # [num_rows, hidden]: each expert's rows contiguous
    grouped_out = torch.empty_like(grouped)  # [num_rows, hidden]
    start = 0
    for index, count in enumerate(rows_per_expert.tolist()):
        if count:
            grouped_out[start : start + count] = expert(index, grouped[start : start + count])
        start += count
    row_outputs = torch.empty_like(grouped_out)
    row_outputs[order] = grouped_out  # back to row order: token t's choices at rows t * top_k ...
    return combine_rows(row_outputs, topk_weights, hidden.dtype)


def fused_moe_ref(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    gate_up: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: gate rows, then up rows
    down: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] routing weights (fp32 or the model dtype)
    topk_ids: torch.Tensor,  # [num_tokens, top_k] expert of each choice
) -> torch.Tensor:  # [num_tokens, hidden]
    def expert(index: int, rows: torch.Tensor) -> torch.Tensor:  # [count, hidden] -> [count, hidden]
        return F.linear(silu_and_mul_ref(F.linear(rows, gate_up[index])), down[index])

    return experts_over_grouped_rows(hidden, topk_weights, topk_ids, gate_up.shape[0], expert)
