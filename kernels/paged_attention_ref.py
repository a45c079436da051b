"""Torch reference: causal attention of a flat batch of queries over each sequence's paged K/V.

One function covers prefill (many query tokens, possibly over a cached prefix) and decode (one query
token per sequence). Query token j of sequence i sits at position ``context_lens[i] - q_len_i + j``
and attends to every cached position at or before it (inside ``sliding_window`` when set).
``sinks`` (gpt-oss), when given, is one learned logit per query head that joins each softmax's
denominator and attends to nothing: the weights of a row sum to less than one. Those layers run the
softmax eagerly, as transformers' gpt-oss does; without sinks every path is scaled_dot_product_attention.
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
    sinks: torch.Tensor | None = None,  # [num_q_heads] attention-sink logits (gpt-oss), or None
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    starts = cu_seqlens_q.tolist()
    kv_lens = context_lens.tolist()
    is_decode = [end - start == 1 for start, end in zip(starts, starts[1:])]
    if is_decode and all(is_decode):  # the common decode step: sequence i's query is token i
        return _decode_batched(query, k_cache, v_cache, context_lens, block_tables, scale, sliding_window, sinks)
    out = torch.empty_like(query)
    decode_seqs = [i for i, one in enumerate(is_decode) if one]
    if decode_seqs:  # decode tokens that share a step with prefill chunks are still batched
        seqs = torch.tensor(decode_seqs, device=query.device)
        tokens = torch.tensor([starts[i] for i in decode_seqs], device=query.device)
        out[tokens] = _decode_batched(
            query[tokens], k_cache, v_cache, context_lens[seqs], block_tables[seqs], scale, sliding_window, sinks
        )
    q_lens = [end - start for start, end in zip(starts, starts[1:])]
    short_seqs = [i for i, n in enumerate(q_lens) if 1 < n <= SHORT_QUERY_MAX_LEN]
    if len(short_seqs) > 1:  # e.g. speculative verify steps: a few query tokens each, batched too
        _short_queries_batched(out, query, k_cache, v_cache, starts, q_lens, short_seqs, context_lens, block_tables,
                               scale, sliding_window, sinks)
    else:
        short_seqs = []
    for i, kv_len in enumerate(kv_lens):
        if is_decode[i] or (short_seqs and 1 < q_lens[i] <= SHORT_QUERY_MAX_LEN):
            continue
        out[starts[i] : starts[i + 1]] = sequence_attention(query[starts[i] : starts[i + 1]], k_cache, v_cache,
                                                            block_tables[i], kv_len, scale, sliding_window, sinks)
    return out


def sequence_attention(
    q: torch.Tensor,  # [q_len, num_q_heads, head_dim]: one sequence's queries, its last q_len positions
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks_per_seq] int32, the sequence's pages
    kv_len: int,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [q_len, num_q_heads, head_dim]
    """One sequence's attention over its K/V gathered from the pages: one ``scaled_dot_product_attention`` call
    (torch's flash-attention kernel on a CPU), causal by position, inside ``sliding_window`` when set."""
    k, v = _gather_kv(k_cache, v_cache, block_table, kv_len)  # [kv_len, num_kv_heads, head_dim]
    if q.shape[0] == kv_len and sliding_window is None and sinks is None:
        mask = None  # a whole prompt: plain causal, which lets the kernel skip the masked half
    else:
        q_pos = torch.arange(kv_len - q.shape[0], kv_len, device=q.device)
        mask = _visible(q_pos, torch.arange(kv_len, device=q.device), sliding_window)
    return _attend(q, k, v, mask, scale, sinks)


# Decode pads each sequence's K/V to the longest context of its bucket; buckets of sequences sorted by
# context length keep the padding (gathered, copied and multiplied for nothing) small in mixed batches.
DECODE_BUCKET_SIZE = 16


# Sequences with at most this many query tokens (and more than one) are padded to their bucket's longest
# query and attended in one call, like decodes, instead of one call each.
SHORT_QUERY_MAX_LEN = 16


def _short_queries_batched(out, query, k_cache, v_cache, starts, q_lens, seqs, context_lens, block_tables, scale,
                           sliding_window, sinks=None) -> None:
    """Write into ``out`` the attention of the sequences ``seqs`` (each 2..SHORT_QUERY_MAX_LEN query tokens)."""
    device = query.device
    seqs_t = torch.tensor(seqs, device=device)
    for rows in torch.argsort(context_lens[seqs_t], stable=True).split(DECODE_BUCKET_SIZE):
        bucket = seqs_t[rows]
        bucket_list = bucket.tolist()
        max_q = max(q_lens[i] for i in bucket_list)
        # [n, max_q] flat token index of each (sequence, query slot); padding slots repeat the last token
        offsets = torch.arange(max_q, device=device)
        lens = torch.tensor([q_lens[i] for i in bucket_list], device=device)
        first = torch.tensor([starts[i] for i in bucket_list], device=device)
        slots = first[:, None] + torch.minimum(offsets[None, :], lens[:, None] - 1)
        is_real = offsets[None, :] < lens[:, None]  # [n, max_q]
        result = _multi_query_padded(query[slots], k_cache, v_cache, lens, context_lens[bucket], block_tables[bucket],
                                     scale, sliding_window, sinks)  # [n, max_q, num_q_heads, head_dim]
        out[slots[is_real]] = result[is_real]


def _multi_query_padded(query, k_cache, v_cache, q_lens, context_lens, block_tables, scale, sliding_window,
                        sinks=None):
    # query [n, max_q, num_q_heads, head_dim]: sequence i's last q_lens[i] positions end at context_lens[i] - 1
    # (padding slots repeat the last query) -> [n, max_q, num_q_heads, head_dim]
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_seqs, max_q = query.shape[:2]
    num_blocks = -(-int(context_lens.max()) // page_size)
    blocks = block_tables[:, :num_blocks].reshape(-1).long()
    padded_len = num_blocks * page_size
    k = k_cache.index_select(0, blocks).view(num_seqs, padded_len, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, blocks).view(num_seqs, padded_len, num_kv_heads, head_dim).transpose(1, 2)
    k_pos = torch.arange(padded_len, device=query.device)  # [padded_len]
    offsets = torch.minimum(torch.arange(max_q, device=query.device)[None, :], q_lens[:, None].long() - 1)
    q_pos = (context_lens.long() - q_lens.long())[:, None] + offsets  # [n, max_q]
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [n, max_q, padded_len]
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    group = query.shape[2] // num_kv_heads
    # [n, kv_heads, group * max_q, head_dim]: a kv head's query heads and slots attend as one block
    q = query.reshape(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs, num_kv_heads, group * max_q, head_dim)
    mask = mask[:, None, None].expand(num_seqs, 1, group, max_q, padded_len).reshape(num_seqs, 1, group * max_q,
                                                                                      padded_len)
    # a row's sink: rows are (query head in the group, query slot), slots fastest
    row_sinks = None if sinks is None else sinks.view(num_kv_heads, group, 1).repeat_interleave(max_q, dim=1)
    attended = _sdpa(q, k.to(q.dtype), v.to(q.dtype), mask, scale, row_sinks)
    attended = attended.reshape(num_seqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    return attended.reshape(num_seqs, max_q, num_kv_heads * group, head_dim)


def _decode_batched(query, k_cache, v_cache, context_lens, block_tables, scale, sliding_window, sinks=None):
    # One query token per sequence: [num_seqs, num_q_heads, head_dim] -> same shape.
    if context_lens.numel() <= DECODE_BUCKET_SIZE:
        return _decode_padded(query, k_cache, v_cache, context_lens, block_tables, scale, sliding_window, sinks)
    out = torch.empty_like(query)
    for rows in torch.argsort(context_lens, stable=True).split(DECODE_BUCKET_SIZE):
        out[rows] = _decode_padded(
            query[rows], k_cache, v_cache, context_lens[rows], block_tables[rows], scale, sliding_window, sinks
        )
    return out


def _decode_padded(query, k_cache, v_cache, context_lens, block_tables, scale, sliding_window, sinks=None):
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
    row_sinks = None if sinks is None else sinks.view(num_kv_heads, group, 1)
    out = _sdpa(q, k.to(q.dtype), v.to(q.dtype), mask[:, None, None, :], scale, row_sinks)
    # [num_seqs, num_kv_heads, group, head_dim]
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


def _attend(q, k, v, mask, scale, sinks=None):
    # mask [q_len, kv_len] bool, or None for causal with q_len == kv_len (never with sinks).
    # enable_gqa: each group of query heads reads its kv head directly, no repeated copy of K/V.
    # A leading batch dim of 1 makes the inputs 4-D, the layout CPU's flash attention kernel takes.
    q = q.transpose(0, 1)[None]  # [1, num_q_heads, q_len, head_dim]
    k = k.transpose(0, 1)[None].to(q.dtype)  # [1, num_kv_heads, kv_len, head_dim]
    v = v.transpose(0, 1)[None].to(q.dtype)
    if sinks is not None:
        group = q.shape[1] // k.shape[1]
        # [1, num_q_heads, kv_len, head_dim]: the eager softmax has no enable_gqa
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = _sdpa(q, k, v, mask, scale, sinks.view(1, -1, 1, 1))
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )  # [1, num_q_heads, q_len, head_dim]
    return out[0].transpose(0, 1)  # [q_len, num_q_heads, head_dim]


def _sdpa(q, k, v, mask, scale, row_sinks):
    """Attention of ``q [..., rows, head_dim]`` over ``k``/``v [..., kv_len, head_dim]`` under the bool ``mask``
    (broadcast to ``[..., rows, kv_len]``); ``row_sinks`` (broadcast to ``[..., rows, 1]``) adds each row's sink.

    With sinks it is transformers' eager gpt-oss attention: the sink logit is concatenated to the masked
    scores, the max subtracted, the softmax taken in the scores' dtype and the sink's column dropped."""
    if row_sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [..., rows, kv_len]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink_column = row_sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)  # [..., rows, 1]
    logits = torch.cat([scores, sink_column], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]  # [..., rows, kv_len]
    return torch.matmul(probs.to(v.dtype), v)
