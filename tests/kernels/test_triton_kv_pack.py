"""Triton pack/unpack of KV blocks against ``kv_pack_ref``: whole caches, per-layer slices, a cache of
another size on the receiving side, dtype casts and strided cache layouts."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_pack_ref import pack_kv_blocks_ref, unpack_kv_blocks_ref
from kernels.triton_kv_pack import pack_kv_blocks_triton, unpack_kv_blocks_triton

NUM_LAYERS = 3


def make_cache(num_blocks, page_size, num_kv_heads, head_dim, dtype=torch.float32, device="cpu"):
    return torch.randn(NUM_LAYERS, 2, num_blocks, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)


@pytest.mark.parametrize("page_size, num_kv_heads, head_dim", [(1, 2, 64), (4, 1, 128), (16, 2, 64), (32, 1, 48)])
@pytest.mark.parametrize("layers", [slice(None), slice(1, 2), slice(0, 3, 2)], ids=["all", "layer1", "step2"])
def test_pack_then_unpack_into_another_cache(device, page_size, num_kv_heads, head_dim, layers):
    source = make_cache(9, page_size, num_kv_heads, head_dim, device=device)
    block_ids = torch.tensor([7, 0, 3], device=device)
    buffer = pack_kv_blocks_triton(source, block_ids, layers)
    expected_buffer = pack_kv_blocks_ref(source, block_ids, layers)
    assert buffer.is_contiguous() and buffer.shape == expected_buffer.shape
    assert torch.equal(buffer, expected_buffer)

    # the receiving worker has a cache of another size and puts the request on other blocks
    target = make_cache(5, page_size, num_kv_heads, head_dim, device=device)
    expected = target.clone()
    dest_ids = torch.tensor([4, 1, 2], device=device)
    unpack_kv_blocks_triton(buffer, target, dest_ids, layers)
    unpack_kv_blocks_ref(expected_buffer, expected, dest_ids, layers)
    assert torch.equal(target, expected)


def test_unpack_casts_to_the_cache_dtype(device):
    buffer = make_cache(2, 4, 2, 64, dtype=torch.float16, device=device)
    target, expected = (make_cache(6, 4, 2, 64, device=device) for _ in range(2))
    expected.copy_(target)
    block_ids = torch.tensor([5, 2], device=device)
    unpack_kv_blocks_triton(buffer, target, block_ids)
    unpack_kv_blocks_ref(buffer, expected, block_ids)
    assert torch.equal(target, expected)


def test_strided_cache_layout(device):
    # a cache whose [page, head, dim] run is not dense takes the unflattening path
    storage = torch.randn(NUM_LAYERS, 2, 6, 2, 4, 64, device=device)  # [..., heads, page, dim]
    cache = storage.transpose(3, 4)  # [..., page, heads, dim], strided
    block_ids = torch.tensor([5, 1], device=device)
    buffer = pack_kv_blocks_triton(cache, block_ids, slice(1, 3))
    assert torch.equal(buffer, pack_kv_blocks_ref(cache, block_ids, slice(1, 3)))
    expected = cache.clone()
    unpack_kv_blocks_triton(buffer * 2, cache, torch.tensor([0, 4], device=device), slice(1, 3))
    unpack_kv_blocks_ref(buffer * 2, expected, torch.tensor([0, 4], device=device), slice(1, 3))
    assert torch.equal(cache, expected)


def test_unpack_rejects_a_buffer_of_the_wrong_shape(device):
    cache = make_cache(4, 4, 1, 64, device=device)
    with pytest.raises(ValueError, match="does not match"):
        unpack_kv_blocks_triton(torch.zeros(1, 2, 2, 4, 1, 64, device=device), cache, torch.tensor([0, 1]))


def test_empty_selection(device):
    cache = make_cache(4, 4, 1, 64, device=device)
    assert pack_kv_blocks_triton(cache, torch.empty(0, dtype=torch.int64), slice(None)).shape == (3, 2, 0, 4, 1, 64)
    assert pack_kv_blocks_triton(cache, torch.tensor([1]), slice(2, 2)).shape == (0, 2, 1, 4, 1, 64)
