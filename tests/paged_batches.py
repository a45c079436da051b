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


def route_prompts_to_flash(monkeypatch, dtypes) -> list[tuple[int, int]]:
    """Route every sequence of 4 or more query rows in ``dtypes`` to torch's flash attention, as an AMX CPU routes
    bf16 prompt chunks (``kernels/cpu_paged_attention.py``); returns the list each routed sequence's
    (query rows, keys) is appended to."""
    from kernels import cpu_paged_attention

    routed: list[tuple[int, int]] = []
    real = cpu_paged_attention.sequence_attention

    def recording(q, k_cache, v_cache, block_table, kv_len, *args):
        routed.append((q.shape[0], kv_len))
        return real(q, k_cache, v_cache, block_table, kv_len, *args)

    monkeypatch.setattr(cpu_paged_attention, "FLASH_MIN_QUERY_ROWS", 4)
    monkeypatch.setattr(cpu_paged_attention, "FLASH_DTYPES", tuple(dtypes))
    monkeypatch.setattr(cpu_paged_attention, "sequence_attention", recording)
    return routed
