"""Torch reference: causal attention of a flat batch of queries over each sequence's paged K/V.

One function covers prefill (many query tokens, possibly over a cached prefix) and decode (one query
token per sequence). Query token j of sequence i sits at position ``context_lens[i] - q_len_i + j``
and attends to every cached position at or before it (inside ``sliding_window`` when set).
This is the CPU path and the oracle the triton kernel is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32, query token offsets into the flat batch
    context_lens: torch.Tensor,  # [num_seqs] int32, K/V length of each sequence after this step
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    num_seqs = context_lens.numel()
    query_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    if num_seqs > 1 and max(query_lens) == 1 and len(query_lens) == query.shape[0]:
        return _decode_batched(query, k_cache, v_cache, context_lens, block_tables, scale, sliding_window)
    out = torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    for i, kv_len in enumerate(context_lens.tolist()):
        q = query[starts[i] : starts[i + 1]]  # [q_len, num_q_heads, head_dim]
        k, v = _gather_kv(k_cache, v_cache, block_tables[i], kv_len)  # [kv_len, num_kv_heads, head_dim]
        q_pos = torch.arange(kv_len - q.shape[0], kv_len, device=query.device)
        mask = _visible(q_pos, torch.arange(kv_len, device=query.device), sliding_window)
        out[starts[i] : starts[i + 1]] = _attend(q, k, v, mask, scale)
    return out


def _decode_batched(query, k_cache, v_cache, context_lens, block_tables, scale, sliding_window):
    # One query per sequence: pad every context to the longest and mask, so decode is one matmul pair.
    page_size = k_cache.shape[1]
    max_len = int(context_lens.max())
    num_blocks = -(-max_len // page_size)
    blocks = block_tables[:, :num_blocks].long()  # [num_seqs, num_blocks]
    num_seqs, num_kv_heads, head_dim = query.shape[0], k_cache.shape[2], k_cache.shape[3]
    k = k_cache[blocks].reshape(num_seqs, num_blocks * page_size, num_kv_heads, head_dim)
    v = v_cache[blocks].reshape(num_seqs, num_blocks * page_size, num_kv_heads, head_dim)
    k_pos = torch.arange(num_blocks * page_size, device=query.device)  # [padded_len]
    q_pos = (context_lens.long() - 1)[:, None]  # [num_seqs, 1]
    mask = k_pos[None, :] <= q_pos
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos - sliding_window
    group = query.shape[1] // num_kv_heads
    q = query[:, :, None, :]  # [num_seqs, num_q_heads, 1, head_dim]
    k = k.transpose(1, 2).repeat_interleave(group, dim=1)  # [num_seqs, num_q_heads, padded_len, head_dim]
    v = v.transpose(1, 2).repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None, None, :], scale=scale)
    return out[:, :, 0, :]


def _gather_kv(k_cache, v_cache, block_table, kv_len):
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    blocks = block_table[: -(-kv_len // page_size)].long()
    k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:kv_len]
    v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:kv_len]
    return k, v


def _visible(q_pos, k_pos, sliding_window):
    mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, kv_len]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


def _attend(q, k, v, mask, scale):
    group = q.shape[1] // k.shape[1]
    q = q.transpose(0, 1)  # [num_q_heads, q_len, head_dim]
    k = k.transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)  # [num_q_heads, kv_len, head_dim]
    v = v.transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)
