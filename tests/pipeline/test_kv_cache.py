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


# ------------------------------------------------------------------ partial tails
def finished(kv: KVCacheManager, seq_id: str, tokens: list[int], num_computed: int) -> None:
    """A sequence that ran ``tokens`` (the KV of the first ``num_computed`` written), then ended."""
    assert kv.allocate(seq_id, tokens, len(tokens)) is not None
    kv.register_computed(seq_id, tokens, num_computed)
    kv.free(seq_id)


def test_the_next_turn_takes_over_the_last_partial_block():
    """A turn ends with KV for 10 tokens (2 full blocks + 2 in a third); the next turn repeats them and
    adds more: it reuses the full blocks and the partial one, and computes from token 10 on."""
    kv = KVCacheManager(num_blocks=16, page_size=4)
    turn_1 = list(range(11))  # the 11th token (the last sampled one) has no KV yet
    finished(kv, "turn-1", turn_1, 10)
    turn_2 = turn_1 + [50, 51, 52]
    assert kv.allocate("turn-2", turn_2, len(turn_2)) == 10
    assert kv.allocate("again", turn_2, len(turn_2)) == 8  # taken: a second reader gets the full blocks only
    assert kv.block_table("again")[:2] == kv.block_table("turn-2")[:2]
    assert kv.block_table("again")[2] != kv.block_table("turn-2")[2]
    for seq in ("turn-2", "again"):
        kv.free(seq)
    assert kv.num_free_blocks == 16


def test_a_partial_tail_shares_only_the_tokens_that_match_and_never_the_last_prompt_token():
    kv = KVCacheManager(num_blocks=16, page_size=4)
    finished(kv, "a", list(range(7)), 7)  # block 1 holds the KV of 4, 5, 6
    assert kv.allocate("b", [0, 1, 2, 3, 4, 5, 99, 98], 8) == 6  # shares 4, 5 of the tail
    kv.free("b")  # b registered nothing: it leaves no tail
    assert kv.allocate("b2", [0, 1, 2, 3, 4, 5, 99, 98], 8) == 4
    kv.free("b2")
    finished(kv, "c", list(range(7)), 7)
    assert kv.allocate("d", list(range(7)), 7) == 6  # the same prompt: its last token is computed again
    kv.free("d")
    finished(kv, "e", list(range(7)), 7)
    assert kv.allocate("f", [0, 1, 2, 3, 77, 5, 6], 7) == 4  # the tail diverges at once: full blocks only
    kv.free("f")
    assert kv.num_free_blocks == 16


def test_a_refused_allocation_leaves_the_tail_for_later():
    kv = KVCacheManager(num_blocks=4, page_size=4)
    finished(kv, "a", list(range(6)), 6)
    assert kv.allocate("hog", list(range(100, 108)), 8) == 0  # 2 of the 4 blocks held
    assert kv.allocate("b", list(range(6)) + list(range(20, 30)), 16) is None  # needs 4
    assert kv.allocate("b", list(range(6)) + [20, 21], 8) == 6  # fits now: the tail is still there
    kv.free("b")
    kv.free("hog")
    assert kv.num_free_blocks == 4


def test_a_partial_tail_is_forgotten_when_its_block_is_handed_out():
    kv = KVCacheManager(num_blocks=4, page_size=4)
    finished(kv, "a", list(range(6)), 6)  # tail [4, 5] in the block freed first: the LRU's first victim
    assert kv.allocate("big", list(range(100, 116)), 16) == 0  # every block, the tail's included
    kv.free("big")
    assert kv.allocate("b", list(range(8)), 8) == 0  # nothing of a's is left
    kv.free("b")
    assert kv.num_free_blocks == 4


def test_the_newest_tail_under_a_prefix_wins_and_prefix_caching_off_keeps_none():
    kv = KVCacheManager(num_blocks=16, page_size=4)
    finished(kv, "a", [0, 1, 2, 3, 10, 11], 6)
    finished(kv, "b", [0, 1, 2, 3, 20, 21], 6)
    assert kv.allocate("c", [0, 1, 2, 3, 10, 11, 12], 7) == 4  # a's tail was replaced by b's
    assert kv.allocate("d", [0, 1, 2, 3, 20, 21, 22], 7) == 6
    kv.free("c")
    kv.free("d")
    assert kv.num_free_blocks == 16
    off = KVCacheManager(num_blocks=16, page_size=4, enable_prefix_caching=False)
    finished(off, "a", [0, 1, 2, 3, 10, 11], 6)
    assert off.allocate("b", [0, 1, 2, 3, 10, 11, 12], 7) == 0


def test_a_short_first_turn_keeps_its_only_block_as_a_tail():
    kv = KVCacheManager(num_blocks=8, page_size=4)
    finished(kv, "a", [5, 6, 7], 3)  # no full block at all
    assert kv.allocate("b", [5, 6, 7, 8, 9], 5) == 3
    kv.free("b")
    assert kv.num_free_blocks == 8


def test_a_withheld_sequence_publishes_nothing_more_nor_its_forks_nor_a_tail():
    """A remote prefill whose sliding layers' early blocks never came: reserved on top of a cached prefix, its
    own blocks never enter the prefix cache (nor the events the router's index reads), nor does a fork's, nor
    a partial tail; the prefix it reused stays cached."""
    kv = KVCacheManager(num_blocks=32, page_size=4)
    kv.record_events()
    shared = list(range(8))
    kv.allocate("warm", shared + [99], 9)
    kv.register_computed("warm", shared + [99], 9)
    kv.free("warm")
    kv.drain_events()
    prompt = shared + list(range(100, 122))  # 30 tokens: 2 blocks cached, 6 more (and a partial) to receive
    assert kv.allocate("remote", prompt, 31) == 8
    kv.withhold("remote")
    kv.register_computed("remote", prompt, 30)
    assert kv.fork("remote", "choice-1", 30) == 28
    kv.register_computed("choice-1", prompt, 30)
    assert kv.drain_events() == ([], [])
    kv.free("remote")
    kv.free("choice-1")
    assert kv.allocate("later", prompt + [7], 31) == 8  # the shared prefix only: no block, no tail of "remote"
    kv.free("later")
    assert kv.num_free_blocks == 32
