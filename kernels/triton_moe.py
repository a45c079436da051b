"""Triton mixture-of-experts: one grouped GEMM launch per projection over rows sorted by expert (vLLM's fused_moe).

The rows (token ``r // top_k``'s choice ``r % top_k``) are sorted by expert and each expert's run is
padded to a whole number of ``BLOCK_M`` tiles, so every tile belongs to one expert: a program multiplies
its tile's rows (gathered from the activations by row id) with that expert's weight and scatters the
result back to the rows' own places. The alignment is computed on the device with no host sync (the
tile count is an upper bound; tiles past the last expert's run exit at once). The oracle is
``kernels.moe_ref.fused_moe_ref``; rows are combined into tokens by the same ``combine_rows``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.activation_ref import silu_and_mul_ref
from kernels.moe_ref import combine_rows
from kernels.triton_common import check_dtype, check_launchable, dot_precision, is_interpreted, next_pow2

BLOCK_M = 16  # rows per tile; tl.dot needs >= 16, and decode batches give each expert a few rows only


def align_rows_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert-sorted row ids padded per expert to ``block_m`` rows, and each tile's expert (-1: an unused tile).

    Returns ``(padded_rows [num_tiles * block_m], tile_experts [num_tiles])``; padding slots hold
    ``num_rows``, an id past every real row, which the kernel masks out.
    """
    flat = topk_ids.reshape(-1)  # [num_rows]
    num_rows = flat.numel()
    num_tiles = -(-num_rows // block_m) + num_experts  # each expert wastes at most one partial tile
    order = torch.argsort(flat, stable=True)  # [num_rows] row ids in expert order
    # (not torch.bincount: on CUDA it reads the largest id back to the host, which a CUDA graph cannot capture)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int64))  # [num_experts]
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded_counts, 0)  # [num_experts]
    expert_of_sorted = flat[order]
    rank = torch.arange(num_rows, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert_of_sorted]
    padded_rows = torch.full((num_tiles * block_m,), num_rows, dtype=torch.int32, device=flat.device)
    padded_rows[(padded_ends - padded_counts)[expert_of_sorted] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(num_tiles, device=flat.device) * block_m
    tile_experts = torch.searchsorted(padded_ends, tile_starts, right=True)  # [num_tiles]
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1).to(torch.int32)
    return padded_rows, tile_experts


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, padded_rows_ptr, tile_experts_ptr,
    num_rows, n_size, k_size, rows_per_a_row,
    stride_a_m, stride_a_k, stride_b_e, stride_b_n, stride_b_k, stride_c_m, stride_c_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOTS_IN_FP32: tl.constexpr,
):
    """C[row, :] = A[row // rows_per_a_row, :] @ B[expert]^T for one tile's rows (one expert's) and columns."""
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile)
    if expert < 0:  # past the last expert's run: the tile count is an upper bound
        return
    rows = tl.load(padded_rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_valid = rows < num_rows
    a_rows = (rows // rows_per_a_row).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_valid = cols < n_size
    b_base = b_ptr + expert.to(tl.int64) * stride_b_e
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, k_size, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_valid = ks < k_size
        a = tl.load(a_ptr + a_rows[:, None] * stride_a_m + ks[None, :] * stride_a_k,
                    mask=row_valid[:, None] & k_valid[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(b_base + cols[None, :] * stride_b_n + ks[:, None] * stride_b_k,
                    mask=k_valid[:, None] & col_valid[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOTS_IN_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_c_m + cols[None, :] * stride_c_n,
             acc.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


def _grouped_gemm(a, weights3d, out, padded_rows, tile_experts, rows_per_a_row):
    """``out[row] = a[row // rows_per_a_row] @ weights3d[expert of row]^T`` for every real row."""
    num_rows = out.shape[0]
    _, n_size, k_size = weights3d.shape
    block_n = min(64, max(16, next_pow2(n_size)))
    block_k = min(64, max(16, next_pow2(k_size)))
    # The CPU interpreter's tl.dot mis-multiplies bf16 (numpy has no bf16), so it gets fp32 dots there.
    dot_dtype = torch.float32 if is_interpreted(_grouped_gemm_kernel) else a.dtype
    grid = (tile_experts.numel(), triton.cdiv(n_size, block_n))
    _grouped_gemm_kernel[grid](
        a, weights3d, out, padded_rows, tile_experts,
        num_rows, n_size, k_size, rows_per_a_row,
        *a.stride(), *weights3d.stride(), *out.stride(),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(dot_dtype), DOTS_IN_FP32=dot_dtype == torch.float32,
    )


def fused_moe_triton(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    gate_up: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    down: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
) -> torch.Tensor:  # [num_tokens, hidden]
    num_tokens, top_k = topk_ids.shape
    num_experts, two_intermediate, hidden_size = gate_up.shape
    if down.shape != (num_experts, hidden_size, two_intermediate // 2) or hidden.shape != (num_tokens, hidden_size):
        raise ValueError(f"fused_moe: hidden {tuple(hidden.shape)}, gate_up {tuple(gate_up.shape)} and down "
                         f"{tuple(down.shape)} do not fit together")
    if num_tokens == 0:
        return torch.empty_like(hidden)
    check_launchable(_grouped_gemm_kernel, hidden, gate_up, down, topk_weights, topk_ids)
    for name, t in (("hidden", hidden), ("gate_up", gate_up), ("down", down)):
        check_dtype(name, t)
    padded_rows, tile_experts = align_rows_by_expert(topk_ids, num_experts, BLOCK_M)
    num_rows = num_tokens * top_k
    gate_up_out = torch.empty((num_rows, two_intermediate), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, gate_up, gate_up_out, padded_rows, tile_experts, top_k)
    activated = silu_and_mul_ref(gate_up_out)  # [num_rows, intermediate]
    row_outputs = torch.empty((num_rows, hidden_size), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(activated, down, row_outputs, padded_rows, tile_experts, 1)
    return combine_rows(row_outputs, topk_weights, hidden.dtype)
