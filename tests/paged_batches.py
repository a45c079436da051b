"""Flat attention batches over a paged cache, for the kernel tests (triton, native CPU, torch reference)."""

from __future__ import annotations

import torch

NUM_LAYERS = 2


def make_batch(q_lens, context_lens, *, num_q_heads, num_kv_heads, head_dim, page_size, dtype=torch.float32,
               device="cpu", spare_blocks=1):
    """A flat batch over one layer's K/V views of a 6-d cache, each sequence on scattered blocks."""
    max_blocks = max(-(-c // page_size) for c in context_lens) + spare_blocks
    num_blocks = max(96, max_blocks + 8)
    kv_cache = torch.randn(NUM_LAYERS, 2, num_blocks, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    block_tables = torch.stack([torch.randperm(num_blocks)[:max_blocks] for _ in context_lens]).int().to(device)
    cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, dtype=dtype, device=device)
    context_lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    # layer 1's views are strided across the outer dims, as the model runner passes them
    return query, kv_cache[1, 0], kv_cache[1, 1], cu_seqlens_q, context_lens, block_tables
