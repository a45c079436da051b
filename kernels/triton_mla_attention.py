"""Triton twin of ``mla_attention_ref``: absorbed multi-head latent attention of a flat batch over a paged latent cache.

Every query head attends over the same latent rows (one "head" per token: the latent ``c`` then the
rotated ``k_rope``), so a program takes one query token and a tile of ``BLOCK_H`` of its heads, reads
each latent row once for all of them, and scores it as ``q_latent . c + q_rope . k_rope`` (two dots, so
neither part is padded to the other's width); the output is the softmax-weighted sum of the ``c`` parts,
from the same tile of rows. Prefill chunks over cached prefixes and decode tokens are the same loop (a
token sees the positions at or before its own), so a mixed step is one launch with no host-side split.
Softmax runs in fp32 with exp2; fp32 inputs use IEEE dots so results match the torch reference.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton_common import check_dtype, check_launchable, dot_precision, is_interpreted, next_pow2


@triton.jit
def _seq_of_token(cu_seqlens_q_ptr, token, num_seqs):
    # the largest sequence whose first query token is at or before ``token``
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_q_ptr + mid) <= token:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _mla_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, kv_lora_rank]
    query_ptr,  # [num_tokens, num_heads, kv_lora_rank + rope_dim]
    cache_ptr,  # [num_blocks, page_size, 1, kv_lora_rank + rope_dim]
    cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr,
    scale_log2, num_seqs, num_heads,
    stride_q_t, stride_q_h, stride_q_d,
    stride_c_b, stride_c_p, stride_c_d,
    stride_o_t, stride_o_h, stride_o_d,
    stride_bt_s, stride_bt_b,
    KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOTS_IN_FP32: tl.constexpr,
):
    token = tl.program_id(0)
    head_tile = tl.program_id(1)
    seq = _seq_of_token(cu_seqlens_q_ptr, token, num_seqs)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_pos = tl.load(context_lens_ptr + seq) - q_len + (token - q_start)  # this token's absolute position

    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = heads < num_heads
    r = tl.arange(0, BLOCK_R)  # latent columns
    r_valid = r < KV_LORA_RANK
    e = tl.arange(0, BLOCK_E)  # rope columns, after the latent ones
    e_valid = e < ROPE_DIM

    q_row = query_ptr + token.to(tl.int64) * stride_q_t + heads[:, None] * stride_q_h
    q_latent = tl.load(q_row + r[None, :] * stride_q_d, mask=head_valid[:, None] & r_valid[None, :], other=0.0)
    q_rope = tl.load(q_row + (KV_LORA_RANK + e[None, :]) * stride_q_d, mask=head_valid[:, None] & e_valid[None, :],
                     other=0.0)  # [BLOCK_H, BLOCK_E]
    if DOTS_IN_FP32:
        q_latent = q_latent.to(tl.float32)
        q_rope = q_rope.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    for n_start in range(0, q_pos + 1, BLOCK_N):
        kv_pos = n_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        kv_valid = kv_pos <= q_pos
        page = tl.load(block_table + (kv_pos // PAGE_SIZE) * stride_bt_b, mask=kv_valid, other=0).to(tl.int64)
        rows = cache_ptr + page * stride_c_b + (kv_pos % PAGE_SIZE) * stride_c_p  # [BLOCK_N] row starts
        latent = tl.load(rows[None, :] + r[:, None] * stride_c_d, mask=r_valid[:, None] & kv_valid[None, :],
                         other=0.0).to(q_latent.dtype)  # [BLOCK_R, BLOCK_N]
        k_rope = tl.load(rows[None, :] + (KV_LORA_RANK + e[:, None]) * stride_c_d,
                         mask=e_valid[:, None] & kv_valid[None, :], other=0.0).to(q_rope.dtype)  # [BLOCK_E, BLOCK_N]
        scores = tl.dot(q_latent, latent, input_precision=DOT_PRECISION)
        scores = (scores + tl.dot(q_rope, k_rope, input_precision=DOT_PRECISION)) * scale_log2  # [BLOCK_H, BLOCK_N]
        scores = tl.where(kv_valid[None, :], scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))  # every row sees position 0 in the first tile: never -inf
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), tl.trans(latent), input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + token.to(tl.int64) * stride_o_t + heads[:, None] * stride_o_h + r[None, :] * stride_o_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_valid[:, None] & r_valid[None, :])


def mla_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank + rope_dim], absorbed
    latent_cache: torch.Tensor,  # [num_blocks, page_size, 1, kv_lora_rank + rope_dim]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:  # [num_tokens, num_heads, kv_lora_rank]
    """Same contract as ``mla_attention_ref``; the launch configuration is chosen from shapes."""
    num_tokens, num_heads, row_dim = query.shape
    num_blocks, page_size, num_rows, cache_dim = latent_cache.shape
    if cache_dim != row_dim or num_rows != 1 or not 0 < kv_lora_rank < row_dim:
        raise ValueError(f"mla_attention: query {tuple(query.shape)} does not fit latent cache "
                         f"{tuple(latent_cache.shape)} with kv_lora_rank {kv_lora_rank}")
    out = torch.empty((num_tokens, num_heads, kv_lora_rank), dtype=query.dtype, device=query.device)
    num_seqs = context_lens.numel()
    if num_tokens == 0 or num_seqs == 0:
        return out
    check_launchable(_mla_attention_kernel, query, latent_cache, cu_seqlens_q, context_lens, block_tables)
    check_dtype("query", query)
    check_dtype("latent_cache", latent_cache)
    rope_dim = row_dim - kv_lora_rank
    # The CPU interpreter's tl.dot mis-multiplies bf16 (numpy has no bf16), so it gets fp32 dots there.
    dot_dtype = torch.float32 if is_interpreted(_mla_attention_kernel) else query.dtype
    block_h = max(16, min(64, next_pow2(num_heads)))  # tl.dot needs every dim >= 16 on GPUs
    block_r = max(16, next_pow2(kv_lora_rank))
    block_n = 16 if block_r >= 512 or dot_dtype == torch.float32 else 32  # the latent tile is [block_r, block_n]
    _mla_attention_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        out, query, latent_cache, cu_seqlens_q, context_lens, block_tables,
        scale * math.log2(math.e), num_seqs, num_heads,
        *query.stride(), latent_cache.stride(0), latent_cache.stride(1), latent_cache.stride(3),
        *out.stride(), *block_tables.stride(),
        KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope_dim, PAGE_SIZE=page_size,
        BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_E=max(16, next_pow2(rope_dim)), BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(dot_dtype), DOTS_IN_FP32=dot_dtype == torch.float32,
        num_warps=4 if block_h * block_r <= 64 * 128 else 8,
    )
    return out
