"""Triton store_kv against ``store_kv_ref``: slot mapping with skips, page sizes, head dims, dtype casts."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_store_ref import store_kv_ref
from kernels.triton_kv_store import store_kv_triton


@pytest.mark.parametrize("page_size, num_kv_heads, head_dim, key_dtype, cache_dtype", [
    pytest.param(1, 2, 64, torch.float32, torch.float32, id="p1-d64"),
    pytest.param(4, 1, 128, torch.float32, torch.float32, id="p4-d128"),
    pytest.param(16, 4, 64, torch.float32, torch.float32, id="p16-kvh4"),
    pytest.param(32, 2, 128, torch.float32, torch.float32, id="p32-d128"),
    pytest.param(16, 2, 48, torch.float32, torch.float32, id="p16-d48-padded"),
    pytest.param(16, 2, 64, torch.float16, torch.float16, id="fp16"),
    pytest.param(16, 2, 64, torch.bfloat16, torch.bfloat16, id="bf16"),
    pytest.param(16, 2, 64, torch.float16, torch.float32, id="fp16-into-fp32-cache"),
])
def test_store_kv_matches_reference(device, page_size, num_kv_heads, head_dim, key_dtype, cache_dtype):
    num_layers, num_blocks, num_tokens = 2, 12, 11
    kv_cache = torch.randn(num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim, dtype=cache_dtype,
                           device=device)
    expected = kv_cache.clone()
    # a strided slice of a fused projection, as the model produces K and V
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, dtype=key_dtype, device=device)
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(num_blocks * page_size)[:num_tokens]
    slots[[1, 4, 9]] = -1  # skipped tokens leave the cache untouched
    slot_mapping = slots.to(device)

    store_kv_triton(key, value, kv_cache[1, 0], kv_cache[1, 1], slot_mapping)
    store_kv_ref(key, value, expected[1, 0], expected[1, 1], slot_mapping)
    torch.testing.assert_close(kv_cache, expected, atol=0, rtol=0)


def test_store_kv_with_no_tokens_is_a_no_op(device):
    kv_cache = torch.randn(1, 2, 2, 4, 1, 64, device=device)
    before = kv_cache.clone()
    empty = torch.empty(0, 1, 64, device=device)
    store_kv_triton(empty, empty, kv_cache[0, 0], kv_cache[0, 1], torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(kv_cache, before)
