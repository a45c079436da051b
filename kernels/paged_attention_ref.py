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
    starts = cu_seqlens_q.tolist()
    kv_lens = context_lens.tolist()
    is_decode = [end - start == 1 for start, end in zip(starts, starts[1:])]
    if is_decode and all(is_decode):  # the common decode step: sequence i's query is token i
        return _decode_batched(query, k_cache, v_cache, context_lens, block_tables, scale, sliding_window)
    out = torch.empty_like(query)
    decode_seqs = [i for i, one in enumerate(is_decode) if one]
    if decode_seqs:  # decode tokens that share a step with prefill chunks are still batched
        seqs = torch.tensor(decode_seqs, device=query.device)
        tokens = torch.tensor([starts[i] for i in decode_seqs], device=query.device)
        out[tokens] = _decode_batched(
            query[tokens], k_cache, v_cache, context_lens[seqs], block_tables[seqs], scale, sliding_window
        )
    for i, kv_len in enumerate(kv_lens):
        if is_decode[i]:
            continue
        q = query[starts[i] : starts[i + 1]]  # [q_len, num_q_heads, head_dim]
        k, v = _gather_kv(k_cache, v_cache, block_tables[i], kv_len)  # [kv_len, num_kv_heads, head_dim]
        if q.shape[0] == kv_len and sliding_window is None:
            mask = None  # a whole prompt: plain causal, which lets the kernel skip the masked half
        else:
            q_pos = torch.arange(kv_len - q.shape[0], kv_len, device=query.device)
            mask = _visible(q_pos, torch.arange(kv_len, device=query.device), sliding_window)
        out[starts[i] : starts[i + 1]] = _attend(q, k, v, mask, scale)
    return out


# Decode pads each sequence's K/V to the longest context of its bucket; buckets of sequences sorted by
# context length keep the padding (gathered, copied and multiplied for nothing) small in mixed batches.
DECODE_BUCKET_SIZE = 16


def _decode_batched(query, k_cache, v_cache, context_lens, block_tables, scale, sliding_window):
    # One query token per sequence: [num_seqs, num_q_heads, head_dim] -> same shape.
    if context_lens.numel() <= DECODE_BUCKET_SIZE:
        return _decode_padded(query, k_cache, v_cache, context_lens, block_tables, scale, sliding_window)
    out = torch.empty_like(query)
    for rows in torch.argsort(context_lens, stable=True).split(DECODE_BUCKET_SIZE):
        out[rows] = _decode_padded(
            query[rows], k_cache, v_cache, context_lens[rows], block_tables[rows], scale, sliding_window
        )
    return out


def _decode_padded(query, k_cache, v_cache, context_lens, block_tables, scale, sliding_window):
    # Pad every context to the longest and mask, so decode is one attention call.
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_seqs = query.shape[0]
    num_blocks = -(-int(context_lens.max()) // page_size)
    blocks = block_tables[:, :num_blocks].reshape(-1).long()  # [num_seqs * num_blocks]
    padded_len = num_blocks * page_size
    # [num_seqs, num_kv_heads, padded_len, head_dim] (strided views of the gathered blocks)
    k = k_cache.index_select(0, blocks).view(num_seqs, padded_len, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, blocks).view(num_seqs, padded_len, num_kv_heads, head_dim).transpose(1, 2)
    k_pos = torch.arange(padded_len, device=query.device)  # [padded_len]
    q_pos = (context_lens.long() - 1)[:, None]  # [num_seqs, 1]
    mask = k_pos[None, :] <= q_pos  # [num_seqs, padded_len]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos - sliding_window
    # The query heads that share a kv head attend as one [group, head_dim] block: K/V are read once
    # per kv head, and no copy repeats them per query head.
    group = query.shape[1] // num_kv_heads
    q = query.reshape(num_seqs, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None, None, :], scale=scale
    )  # [num_seqs, num_kv_heads, group, head_dim]
    return out.reshape(num_seqs, num_kv_heads * group, head_dim)


def _gather_kv(k_cache, v_cache, block_table, kv_len):
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    blocks = block_table[: -(-kv_len // page_size)].long()
    k = k_cache.index_select(0, blocks).reshape(-1, num_kv_heads, head_dim)[:kv_len]
    v = v_cache.index_select(0, blocks).reshape(-1, num_kv_heads, head_dim)[:kv_len]
    return k, v


def _visible(q_pos, k_pos, sliding_window):
    mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, kv_len]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


def _attend(q, k, v, mask, scale):
    # mask [q_len, kv_len] bool, or None for causal with q_len == kv_len.
    # enable_gqa: each group of query heads reads its kv head directly, no repeated copy of K/V.
    # A leading batch dim of 1 makes the inputs 4-D, the layout CPU's flash attention kernel takes.
    q = q.transpose(0, 1)[None]  # [1, num_q_heads, q_len, head_dim]
    k = k.transpose(0, 1)[None].to(q.dtype)  # [1, num_kv_heads, kv_len, head_dim]
    v = v.transpose(0, 1)[None].to(q.dtype)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )  # [1, num_q_heads, q_len, head_dim]
    return out[0].transpose(0, 1)  # [q_len, num_q_heads, head_dim]
