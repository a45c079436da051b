"""Triton twin of ``paged_attention_ref``: causal attention of a flat batch over paged K/V.

One kernel serves prefill (over a cached prefix, chunked or not) and decode, because the work is the
same online-softmax loop over one sequence's pages and the batch is flat: a step that mixes prefill
chunks with decode tokens runs as one launch with no host-side split and no device-to-host sync, so
it can sit inside a CUDA graph. Each program owns a tile of ``BLOCK_Q`` consecutive query tokens of
one sequence times the ``group`` query heads that share a KV head (GQA), packed into the M rows of
the tile; decode uses ``BLOCK_Q = 1``, so the M rows are that token's query heads and every K/V page
is read once per KV head rather than once per query head.

Long decode contexts leave most of the GPU idle when there are few sequences x KV heads, so the same
kernel takes a third grid axis (flash-decoding split-KV): split ``s`` covers the s-th slice of each
tile's visible KV range and writes a normalised partial output plus its log-sum-exp; a small reduce
kernel merges the splits. The split count depends only on tensor shapes, never on values.

Query token j of sequence i sits at absolute position ``context_lens[i] - q_len_i + j`` and sees K/V
positions at or before it (and after ``position - sliding_window`` when a window is set). K/V rows
are gathered per position through the block table, so any page size works (1, 4, 16, 32, ...).
Softmax runs in fp32 with exp2; fp32 inputs use IEEE dots so results match the torch reference.
Attention sinks (gpt-oss: one logit per query head that joins the softmax's denominator and attends to
nothing) start split 0's online softmax at the sink's logit with weight one; the other splits start
empty, so the reduce counts the sink once.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kernels.triton_common import check_dtype, check_launchable, dot_precision, is_interpreted, next_pow2

# Split-KV heuristics: aim for a few waves of programs, but give each split at least this many tokens.
MIN_TOKENS_PER_SPLIT = 256
MAX_KV_SPLITS = 32
PROGRAMS_PER_SM = 4


@triton.jit
def _find_seq(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    # Largest seq whose first tile index (cu_q // BLOCK_Q + seq; plain cu_q when BLOCK_Q == 1) <= tile.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid)
        if BLOCK_Q > 1:
            first_tile = first_tile // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim], or fp32 [num_tokens, num_q_heads, NUM_SPLITS, head_dim]
    lse_ptr,  # fp32 [num_tokens, num_q_heads, NUM_SPLITS], log2-domain; unused when NUM_SPLITS == 1
    query_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr,
    sinks_ptr,  # [num_q_heads] sink logits; unused without HAS_SINKS
    scale_log2, sliding_window, num_seqs,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_b, stride_k_p, stride_k_h, stride_k_d,
    stride_v_b, stride_v_p, stride_v_h, stride_v_d,
    stride_o_t, stride_o_h, stride_o_s, stride_o_d,
    stride_lse_t, stride_lse_h,
    stride_bt_s, stride_bt_b,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr, DOTS_IN_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first_tile = q_start
    if BLOCK_Q > 1:
        first_tile = q_start // BLOCK_Q + seq
    local_tile = tile - first_tile
    if local_tile * BLOCK_Q >= q_len:  # grid is an upper bound on the number of tiles
        return
    context_len = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)  # row r = query token r // GROUP, query head r % GROUP of this KV head
    q_idx = local_tile * BLOCK_Q + rows // GROUP  # [BLOCK_M] index inside the sequence's queries
    row_valid = (rows // GROUP < BLOCK_Q) & (q_idx < q_len)
    q_head = kv_head * GROUP + rows % GROUP
    q_pos = context_len - q_len + q_idx  # [BLOCK_M] absolute position of each row's token
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM

    token = (q_start + q_idx).to(tl.int64)
    q_ptrs = query_ptr + token[:, None] * stride_q_t + q_head[:, None] * stride_q_h + dims[None, :] * stride_q_d
    q = tl.load(q_ptrs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if DOTS_IN_FP32:
        q = q.to(tl.float32)

    # KV range this tile can see, then this split's share of it (rounded to whole BLOCK_N tiles).
    first_pos = context_len - q_len + local_tile * BLOCK_Q
    kv_end = tl.minimum(context_len, first_pos + BLOCK_Q)
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(first_pos - sliding_window + 1, 0)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_start = kv_start + split * per_split
        kv_end = tl.minimum(kv_end, kv_start + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if HAS_SINKS:  # the sink as one more score (log2 domain) of weight one, in split 0 only
        in_split_0 = rows * 0 + split == 0  # [BLOCK_M]
        sink = tl.load(sinks_ptr + q_head, mask=row_valid & in_split_0, other=float("-inf")).to(tl.float32)
        m_i = sink * 1.4426950408889634  # log2(e)
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    k_head = k_cache_ptr + kv_head * stride_k_h
    v_head = v_cache_ptr + kv_head * stride_v_h
    for n_start in range(kv_start, kv_end, BLOCK_N):
        kv_pos = n_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        kv_valid = kv_pos < kv_end
        page = tl.load(block_table + (kv_pos // PAGE_SIZE) * stride_bt_b, mask=kv_valid, other=0).to(tl.int64)
        in_page = kv_pos % PAGE_SIZE
        kv_mask = kv_valid[None, :] & dim_valid[:, None]
        k_ptrs = k_head + page[None, :] * stride_k_b + in_page[None, :] * stride_k_p + dims[:, None] * stride_k_d
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_D, BLOCK_N]
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]

        visible = kv_valid[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet stay at zero
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_head + page[:, None] * stride_v_b + in_page[:, None] * stride_v_p + dims[None, :] * stride_v_d
        v = tl.load(v_ptrs, mask=kv_valid[:, None] & dim_valid[None, :], other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = (out_ptr + token[:, None] * stride_o_t + q_head[:, None] * stride_o_h + split * stride_o_s
              + dims[None, :] * stride_o_d)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
    if NUM_SPLITS > 1:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + token * stride_lse_t + q_head * stride_lse_h + split, lse, mask=row_valid)


@triton.jit
def _reduce_splits_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    partial_ptr,  # fp32 [num_tokens, num_q_heads, num_splits, head_dim]
    lse_ptr,  # fp32 [num_tokens, num_q_heads, num_splits]
    num_splits,
    stride_o_t, stride_o_h, stride_o_d,
    stride_p_t, stride_p_h, stride_p_s, stride_p_d,
    stride_lse_t, stride_lse_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    lse = tl.load(lse_ptr + token * stride_lse_t + head * stride_lse_h + splits, mask=splits < num_splits,
                  other=float("-inf"))  # [BLOCK_S]
    lse_max = tl.max(lse, 0)
    weights = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))  # empty splits weigh 0
    p_ptrs = (partial_ptr + token * stride_p_t + head * stride_p_h + splits[:, None] * stride_p_s
              + dims[None, :] * stride_p_d)
    partial = tl.load(p_ptrs, mask=(splits[:, None] < num_splits) & (dims[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(weights, 0)
    out = tl.sum(partial * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)  # [BLOCK_D]
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + dims * stride_o_d,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32, query token offsets into the flat batch
    context_lens: torch.Tensor,  # [num_seqs] int32, K/V length of each sequence after this step
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_q_heads] attention-sink logits (gpt-oss), or None
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Same contract as ``paged_attention_ref``; the launch configuration is chosen from shapes."""
    return run_paged_attention(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                               sliding_window, sinks)


def choose_num_kv_splits(num_tokens: int, num_seqs: int, num_kv_heads: int, max_context: int,
                         device: torch.device) -> int:
    """Split-KV only for decode-only batches whose (sequence, KV head) programs cannot fill the GPU."""
    if num_tokens != num_seqs or device.type != "cuda":
        return 1
    num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    by_occupancy = math.ceil(PROGRAMS_PER_SM * num_sms / max(num_seqs * num_kv_heads, 1))
    by_length = max_context // MIN_TOKENS_PER_SPLIT
    return int(max(1, min(by_occupancy, by_length, MAX_KV_SPLITS)))


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def run_paged_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    *, num_kv_splits: int | None = None, block_n: int | None = None, block_m: int | None = None,
) -> torch.Tensor:
    """``paged_attention_triton`` with the launch knobs exposed (tests force the split-KV path here)."""
    num_tokens, num_q_heads, head_dim = query.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.numel()
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    check_launchable(_paged_attention_kernel, query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables)
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(name, t)
    if num_q_heads % num_kv_heads or k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_attention: query {tuple(query.shape)} does not fit cache {tuple(k_cache.shape)}")
    if sinks is not None and (sinks.shape != (num_q_heads,) or sinks.device != query.device):
        raise ValueError(f"paged_attention: sinks {tuple(sinks.shape)} must be one logit per query head "
                         f"({num_q_heads}) on the query's device")
    group = num_q_heads // num_kv_heads
    # The CPU interpreter's tl.dot mis-multiplies bf16 (numpy has no bf16), so it gets fp32 dots there.
    dot_dtype = torch.float32 if is_interpreted(_paged_attention_kernel) else query.dtype

    # One query per sequence (decode): one token per tile. BLOCK_Q == 1 is correct for any batch, only
    # slower for long prefills; tiles of BLOCK_Q > 1 would waste rows on every decode token.
    is_decode = num_tokens == num_seqs
    if is_decode:
        block_q, block_m_ = 1, max(16, next_pow2(group))
    else:
        block_m_ = max(block_m or 64, next_pow2(group))
        block_q = block_m_ // group
    block_d = max(16, next_pow2(head_dim))  # tl.dot needs every dim >= 16 on GPUs
    # fp32 dots run on FMA units and stage wider tiles in shared memory: keep their KV tiles narrower
    block_n_ = block_n or (64 if block_d <= 128 and query.dtype != torch.float32 else 32)
    num_tiles = num_tokens if block_q == 1 else num_tokens // block_q + num_seqs
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(num_tokens, num_seqs, num_kv_heads,
                                             block_tables.shape[1] * page_size, query.device)

    if num_kv_splits > 1:
        target = torch.empty((num_tokens, num_q_heads, num_kv_splits, head_dim), dtype=torch.float32,
                             device=query.device)
        lse = torch.empty((num_tokens, num_q_heads, num_kv_splits), dtype=torch.float32, device=query.device)
        target_strides, lse_strides = target.stride(), lse.stride()[:2]
    else:
        target, lse = out, out  # lse is never touched with one split
        target_strides, lse_strides = (*out.stride()[:2], 0, out.stride(2)), (0, 0)

    _paged_attention_kernel[(num_tiles, num_kv_heads, num_kv_splits)](
        target, lse, query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
        query if sinks is None else sinks.contiguous(),  # any pointer when there are no sinks
        scale * math.log2(math.e), int(sliding_window or 0), num_seqs,
        *query.stride(), *k_cache.stride(),
        *v_cache.stride(), *target_strides, *lse_strides, *block_tables.stride(),
        GROUP=group, PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_Q=block_q, BLOCK_M=block_m_, BLOCK_N=block_n_, NUM_SPLITS=num_kv_splits,
        USE_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None, DOT_PRECISION=dot_precision(dot_dtype),
        DOTS_IN_FP32=dot_dtype == torch.float32,
        num_warps=4 if block_m_ * block_d <= 64 * 128 else 8,
    )
    if num_kv_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_q_heads)](
            out, target, lse, num_kv_splits,
            *out.stride(), *target.stride(), *lse.stride()[:2],
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=next_pow2(num_kv_splits),
        )
    return out
