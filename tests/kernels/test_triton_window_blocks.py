"""The triton paged attention never lets a sliding layer's blocks before ``first_needed_block`` matter (the
blocks a P/D transfer does not send, ``kv_transfer/sliding_window.py``): garbage there leaves its output bit
for bit the same, split-KV included, and a change in the first needed block shows."""

from __future__ import annotations

import pytest
import torch

from kernels.triton_paged_attention import run_paged_attention
from kv_transfer.sliding_window import first_needed_block

PAGE = 4


@pytest.mark.parametrize("window,num_tokens,num_queries,num_kv_splits", [(8, 40, 1, 1), (8, 37, 1, 4), (5, 29, 3, 1)])
def test_blocks_before_the_window_never_change_the_output(device, window, num_tokens, num_queries, num_kv_splits):
    gen = torch.Generator().manual_seed(window + num_tokens)
    num_kv_heads, head_dim, num_q_heads = 2, 16, 4
    kv_len = num_tokens + num_queries
    num_blocks = -(-kv_len // PAGE)
    k_cache = torch.randn(num_blocks, PAGE, num_kv_heads, head_dim, generator=gen).to(device)
    v_cache = torch.randn(num_blocks, PAGE, num_kv_heads, head_dim, generator=gen).to(device)
    query = torch.randn(num_queries, num_q_heads, head_dim, generator=gen).to(device)
    batch = (torch.tensor([0, num_queries], dtype=torch.int32, device=device),
             torch.tensor([kv_len], dtype=torch.int32, device=device),
             torch.arange(num_blocks, dtype=torch.int32, device=device)[None])
    knobs = dict(num_kv_splits=num_kv_splits) if num_kv_splits > 1 else {}

    def attend(k, v):
        return run_paged_attention(query, k, v, *batch, head_dim ** -0.5, window, **knobs)

    before = attend(k_cache, v_cache)
    first = first_needed_block(window, PAGE, num_tokens)
    garbage_k, garbage_v = k_cache.clone(), v_cache.clone()
    garbage_k[:first] = 1e4 * torch.randn(first, PAGE, num_kv_heads, head_dim, generator=gen).to(device)
    garbage_v[:first] = 1e4 * torch.randn(first, PAGE, num_kv_heads, head_dim, generator=gen).to(device)
    assert torch.equal(attend(garbage_k, garbage_v), before)
    garbage_v[first] += 1.0
    assert not torch.equal(attend(garbage_k, garbage_v), before)
