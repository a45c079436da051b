"""The request checksum: same value from a packed buffer and from the cache, and what it catches."""

from __future__ import annotations

import pytest
import torch

from kernels import load_kernels
from kv_transfer.checksum import KVChecksum
from tests.kv_transfer.helpers import random_cache

PACK = load_kernels("torch").pack_kv_blocks
LAYOUTS = [  # (shape, dtype): 8-byte words, 4-byte words, odd 2-byte pages, big pages
    ((3, 2, 10, 4, 2, 8), torch.float32),
    ((2, 2, 6, 16, 8, 128), torch.bfloat16),
    ((2, 2, 5, 3, 1, 3), torch.float16),
    ((2, 2, 5, 1, 1, 2), torch.float16),
]


def _page_bytes(cache: torch.Tensor) -> int:
    return cache[0, 0, 0].numel() * cache.element_size()


def _over_blocks(cache, ids, pieces) -> int:
    checksum = KVChecksum(_page_bytes(cache))
    for layers in pieces:
        checksum.update_blocks(cache, ids, layers)
    return checksum.value


@pytest.mark.parametrize("shape,dtype", LAYOUTS)
def test_packed_and_in_cache_agree(shape, dtype):
    cache = random_cache(shape, dtype, seed=3)
    ids = [4, 0, 1, 2, 3][: shape[2]]  # a run of consecutive blocks and a lone one
    pieces = [slice(0, 1), slice(1, shape[0])]
    packed = KVChecksum(_page_bytes(cache))
    for layers in pieces:
        packed.update_packed(PACK(cache, torch.tensor(ids), layers))
    assert packed.value == _over_blocks(cache, ids, pieces)
    assert packed.num_bytes == cache[:, :, ids].numel() * cache.element_size()


@pytest.mark.parametrize("shape,dtype", LAYOUTS)
def test_every_single_bit_flip_is_caught(shape, dtype):
    cache = random_cache(shape, dtype, seed=4)
    ids = [1, 3]
    reference = _over_blocks(cache, ids, [slice(None)])
    raw = cache.view(torch.uint8).view(shape[0], 2, shape[2], -1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        layer, kv = torch.randint(shape[0], (1,), generator=gen).item(), torch.randint(2, (1,), generator=gen).item()
        block = ids[torch.randint(2, (1,), generator=gen).item()]
        offset = torch.randint(raw.shape[-1], (1,), generator=gen).item()
        bit = 1 << torch.randint(8, (1,), generator=gen).item()
        raw[layer, kv, block, offset] ^= bit
        assert _over_blocks(cache, ids, [slice(None)]) != reference
        raw[layer, kv, block, offset] ^= bit
    assert _over_blocks(cache, ids, [slice(None)]) == reference


def test_misplaced_or_missing_pages_are_caught():
    cache = random_cache((2, 2, 6, 16, 8, 128), torch.bfloat16, seed=5)
    reference = _over_blocks(cache, [0, 1, 2], [slice(None)])
    assert _over_blocks(cache, [1, 0, 2], [slice(None)]) != reference  # two blocks swapped
    assert _over_blocks(cache, [0, 1], [slice(None)]) != reference  # a block missing
    assert _over_blocks(cache, [0, 1, 2], [slice(1, 2), slice(0, 1)]) != reference  # layers swapped
    swapped_kv = cache.clone()
    swapped_kv[:, [0, 1]] = cache[:, [1, 0]]
    assert _over_blocks(swapped_kv, [0, 1, 2], [slice(None)]) != reference  # K and V exchanged


def test_stream_is_independent_of_how_it_is_cut():
    cache = random_cache((4, 2, 6, 4, 2, 8), seed=6)
    whole = PACK(cache, torch.tensor([5, 2, 3]))
    one = KVChecksum(_page_bytes(cache))
    one.update_packed(whole)
    cut = KVChecksum(_page_bytes(cache))
    for part in whole.view(-1).split(4 * 2 * 8 * 3):  # whole pages, odd boundaries
        cut.update_packed(part)
    assert one.value == cut.value
