import pytest

from pipeline.kv_cache import KVCacheManager


def test_allocate_grow_free_returns_every_block():
    kv = KVCacheManager(num_blocks=10, page_size=4)
    assert kv.allocate("a", list(range(6)), 6) == 0
    assert kv.block_table("a") and len(kv.block_table("a")) == 2
    assert kv.ensure_capacity("a", 9) and len(kv.block_table("a")) == 3
    assert kv.num_free_blocks == 7
    kv.free("a")
    kv.free("a")  # idempotent
    assert kv.num_free_blocks == 10


def test_allocation_fails_atomically_when_short():
    kv = KVCacheManager(num_blocks=3, page_size=4)
    assert kv.allocate("a", list(range(8)), 8) == 0
    assert kv.allocate("b", list(range(100, 108)), 8) is None
    assert not kv.has_sequence("b") and kv.num_free_blocks == 1
    assert not kv.ensure_capacity("a", 13)
    assert len(kv.block_table("a")) == 2


def test_watermark_limits_admission():
    kv = KVCacheManager(num_blocks=10, page_size=1)
    assert kv.allocate("a", [1] * 5, 5, max_usage=0.5) == 0
    assert kv.allocate("b", [2], 1, max_usage=0.5) is None
    assert kv.allocate("b", [2], 1, max_usage=1.0) == 0


def test_prefix_reuse_shares_blocks_and_keeps_last_token_uncached():
    kv = KVCacheManager(num_blocks=16, page_size=4)
    prompt = list(range(12))
    kv.allocate("a", prompt, 12)
    kv.register_computed("a", prompt, 12)
    # Same 12 tokens: only two blocks may be reused, the last token must be recomputed.
    assert kv.allocate("b", prompt, 12) == 8
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.block_table("b")[2] != kv.block_table("a")[2]
    # A different second block breaks the chain after the first.
    other = prompt[:4] + [99] * 8
    assert kv.allocate("c", other, 12) == 4
    for seq in "abc":
        kv.free(seq)
    assert kv.num_free_blocks == 16


def test_cached_blocks_count_as_free_and_are_evicted_lru():
    kv = KVCacheManager(num_blocks=4, page_size=2)
    kv.allocate("a", [1, 2, 3, 4, 5], 5)
    kv.register_computed("a", [1, 2, 3, 4, 5], 5)
    kv.free("a")
    assert kv.num_free_blocks == 4
    assert kv.allocate("b", [1, 2, 3, 4, 9], 5) == 4  # revived from the free pool
    kv.free("b")
    kv.allocate("c", list(range(20, 28)), 8)  # needs every block: the cache is evicted
    kv.free("c")
    assert kv.allocate("d", [1, 2, 3, 4, 9], 5) == 0


def test_rejects_bad_sizes_and_double_allocation():
    with pytest.raises(ValueError):
        KVCacheManager(0, 4)
    kv = KVCacheManager(4, 4)
    kv.allocate("a", [1], 1)
    with pytest.raises(ValueError, match="already holds"):
        kv.allocate("a", [1], 1)
