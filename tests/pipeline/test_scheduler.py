"""Scheduler decisions without a model: fake tokens, real block manager."""

import pytest

from pipeline.kv_cache import KVCacheManager
from pipeline.protocol import SamplingParams
from pipeline.scheduler import QueueFullError, Scheduler
from pipeline.sequence import Sequence, SequenceStatus


def make_seq(request_id, prompt_len, max_tokens):
    prompt = [hash((request_id, i)) % 1000 for i in range(prompt_len)]
    return Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens), prompt_len + max_tokens)


def run_to_completion(scheduler, seqs, max_steps=10_000):
    """Drive steps, finishing sequences at their length; returns the per-step plans."""
    plans = []
    for _ in range(max_steps):
        if not scheduler.num_unfinished:
            return plans
        plan = scheduler.schedule()
        plans.append(plan)
        num_sampling = sum(c.is_sampling for c in plan.chunks)
        for seq in scheduler.update(plan, [7] * num_sampling):
            if seq.num_tokens >= seq.max_total_tokens:
                scheduler.finish(seq, "length")
    raise AssertionError("scheduler did not finish")


def test_chunked_prefill_respects_token_budget_and_batches_decodes():
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(kv, max_batch_size=8, max_batch_input_tokens=10)
    seqs = [make_seq(f"r{i}", 13 + i, 5) for i in range(4)]
    for s in seqs:
        scheduler.add(s)
    plans = run_to_completion(scheduler, seqs)
    for plan in plans:
        assert sum(c.num_tokens for c in plan.chunks) <= 10
    assert all(s.num_output_tokens == 5 and s.is_finished for s in seqs)
    assert any(len(p.chunks) > 1 for p in plans)  # decodes and prefill chunks share steps
    assert kv.num_free_blocks == 64


def test_a_remote_prefill_above_the_watermark_takes_the_whole_pool_when_nothing_else_holds_blocks():
    """A prompt that fits the pool but not under the watermark (61 of 64 blocks, 0.95 x 64 = 60.8) is reserved
    once nothing runs or waits for KV: nothing would free blocks for it (an audit saw it, and every request queued
    behind it, wait forever on a prefill / decode split). While something holds blocks, the watermark holds."""
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(kv, max_batch_size=8, max_batch_input_tokens=64, kvcache_ce_watermark=0.95)  # the default's
    scheduler.add_remote(make_seq("small", 7, 2))
    (small,) = scheduler.reserve_remote()
    scheduler.add_remote(make_seq("big", 243, 2))  # 243 + the first token = 61 blocks of 4
    scheduler.add_remote(make_seq("after", 3, 2))
    assert scheduler.reserve_remote() == []  # "small" holds 2 blocks: 63 > the watermark's 60.8
    scheduler.reserved.pop("small")
    kv.free("small")
    assert [s.request_id for s in scheduler.reserve_remote()] == ["big"]  # "after" needs a block more than is left
    assert kv.num_free_blocks == 3


def test_max_batch_size_caps_running_requests():
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(kv, max_batch_size=2, max_batch_input_tokens=100)
    for i in range(5):
        scheduler.add(make_seq(f"r{i}", 3, 4))
    max_running = 0
    while scheduler.num_unfinished:
        plan = scheduler.schedule()
        max_running = max(max_running, len(scheduler.running))
        for seq in scheduler.update(plan, [1] * sum(c.is_sampling for c in plan.chunks)):
            if seq.num_tokens >= seq.max_total_tokens:
                scheduler.finish(seq, "length")
    assert max_running == 2
    assert kv.num_free_blocks == 64


def test_reserved_and_paused_requests_keep_their_rows():
    """A DecodeOnly worker mixes local prompts with remote ones: a request reserved for its prefill worker's KV
    runs when the KV lands, and one paused for a drain's handoff runs again if the handoff is declined. Neither
    may find its row taken: the persistent batch has max_batch_size rows and a worker that overfilled it died
    ("the sequence buffer is full"), failing every request it held (an audit's rolling restart)."""
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(kv, max_batch_size=2, max_batch_input_tokens=100)
    scheduler.add_remote(make_seq("remote", 6, 4))
    (remote,) = scheduler.reserve_remote()
    for i in range(2):
        scheduler.add(make_seq(f"local{i}", 3, 4))
    plan = scheduler.schedule()
    assert [c.seq.request_id for c in plan.chunks] == ["local0"]  # one row left beside the reserved one
    scheduler.update(plan, [1])
    scheduler.activate_remote(remote, first_token_id=5)  # its KV landed
    assert len(scheduler.running) == 2
    scheduler.finish(remote, "length")

    running = scheduler.running[0]
    scheduler.pause(running)  # a drain hands its KV off
    plan = scheduler.schedule()
    assert [c.seq.request_id for c in plan.chunks] == ["local1"]
    scheduler.update(plan, [1])
    scheduler.add(make_seq("local2", 3, 4))
    plan = scheduler.schedule()
    scheduler.update(plan, [1] * sum(c.is_sampling for c in plan.chunks))
    assert len(scheduler.running) == 1  # local2 waits: the paused one's row
    scheduler.unpause(running)  # nobody took it
    assert len(scheduler.running) == 2 and [s.request_id for s in scheduler.waiting] == ["local2"]


def test_preemption_by_recompute_when_blocks_run_out():
    kv = KVCacheManager(6, 2)  # 12 token slots for 3 sequences that each grow to 8 tokens
    scheduler = Scheduler(kv, max_batch_size=8, max_batch_input_tokens=64)
    seqs = [make_seq(f"r{i}", 3, 5) for i in range(3)]
    for s in seqs:
        scheduler.add(s)
    plans = run_to_completion(scheduler, seqs)
    assert any(p.preempted for p in plans)
    assert sum(s.num_preemptions for s in seqs) >= 1
    assert all(s.num_output_tokens == 5 for s in seqs)
    assert kv.num_free_blocks == 6


def test_without_chunked_prefill_whole_prompts_only():
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(kv, max_batch_size=8, max_batch_input_tokens=12, enable_chunked_prefill=False)
    a, b = make_seq("a", 10, 2), make_seq("b", 10, 2)
    scheduler.add(a)
    scheduler.add(b)
    plan = scheduler.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in plan.chunks] == [("a", 10)]
    assert b.status is SequenceStatus.WAITING and not kv.has_sequence("b")


def test_queue_bound_and_abort_frees_blocks():
    kv = KVCacheManager(16, 4)
    scheduler = Scheduler(kv, max_batch_size=4, max_batch_input_tokens=4, max_queue_size=2)
    a, b = make_seq("a", 9, 3), make_seq("b", 9, 3)
    scheduler.add(a)
    scheduler.add(b)
    with pytest.raises(QueueFullError):
        scheduler.add(make_seq("c", 2, 2))
    scheduler.update(scheduler.schedule(), [])  # a is half-way through its prefill
    assert a.status is SequenceStatus.RUNNING and 0 < a.num_computed_tokens < a.num_prompt_tokens
    scheduler.finish(a, "abort")
    scheduler.finish(b, "abort")
    assert scheduler.num_unfinished == 0 and kv.num_free_blocks == 16


def test_decodes_run_every_step_while_an_older_long_prompt_is_chunked_beside_them():
    kv = KVCacheManager(1024, 4)
    scheduler = Scheduler(kv, max_batch_size=8, max_batch_input_tokens=203)
    scheduler.add(make_seq("short", 3, 40))
    scheduler.add(make_seq("long", 2000, 2))
    plan = scheduler.schedule()  # both admitted: the short prompt, then the long prompt's first chunk
    assert [(c.seq.request_id, c.num_tokens) for c in plan.chunks] == [("short", 3), ("long", 200)]
    scheduler.update(plan, [7])
    scheduler.running.reverse()  # the order after the short one was preempted and admitted again
    scheduler.max_batch_input_tokens = 16
    for _ in range(20):
        plan = scheduler.schedule()
        assert [(c.seq.request_id, c.num_tokens) for c in plan.chunks] == [("short", 1), ("long", 15)], (
            "the older prompt's chunk must not displace the running decode")
        scheduler.update(plan, [7] * sum(c.is_sampling for c in plan.chunks))


def step(scheduler):
    plan = scheduler.schedule()
    for seq in scheduler.update(plan, [7] * sum(c.is_sampling for c in plan.chunks)):
        if seq.num_tokens >= seq.max_total_tokens:
            scheduler.finish(seq, "length")
    return plan


def test_a_short_prompt_shares_the_step_of_a_long_one_in_progress():
    kv = KVCacheManager(256, 4)
    scheduler = Scheduler(kv, max_batch_size=8, max_batch_input_tokens=64, long_prefill_token_threshold=16)
    long, short = make_seq("long", 200, 2), make_seq("short", 10, 2)
    scheduler.add(long)
    first = step(scheduler)  # alone: the whole budget, no cap
    assert [(c.seq.request_id, c.num_tokens) for c in first.chunks] == [("long", 64)]
    scheduler.add(short)
    second = step(scheduler)  # the short prompt is admitted beside it and finishes its prefill
    assert [(c.seq.request_id, c.num_tokens) for c in second.chunks] == [("long", 54), ("short", 10)]
    assert short.num_output_tokens == 1
    third = step(scheduler)  # nobody waits: decode first, the rest of the budget to the long prompt
    assert [(c.seq.request_id, c.num_tokens) for c in third.chunks] == [("short", 1), ("long", 63)]
    run_to_completion(scheduler, [long, short])
    assert kv.num_free_blocks == 256


def test_waiting_long_prompts_share_the_step_and_lose_no_budget():
    kv = KVCacheManager(256, 4)
    scheduler = Scheduler(kv, max_batch_size=8, max_batch_input_tokens=64, long_prefill_token_threshold=16)
    seqs = [make_seq(f"r{i}", 100, 2) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    plan = step(scheduler)
    # every admission capped at 16 while others wait, then the leftover back to the oldest
    assert [(c.seq.request_id, c.num_tokens) for c in plan.chunks] == [("r0", 32), ("r1", 16), ("r2", 16)]
    plans = run_to_completion(scheduler, seqs)
    assert all(sum(c.num_tokens for c in p.chunks) <= 64 for p in plans)
    assert all(s.num_output_tokens == 2 for s in seqs) and kv.num_free_blocks == 256


def test_beside_decodes_prompt_chunks_take_at_most_the_cap_and_alone_the_whole_budget():
    kv = KVCacheManager(256, 4)
    scheduler = Scheduler(kv, max_batch_size=8, max_batch_input_tokens=64, max_prefill_tokens_beside_decodes=8)
    short, long = make_seq("short", 3, 8), make_seq("long", 200, 2)
    scheduler.add(short)
    assert [(c.seq.request_id, c.num_tokens) for c in step(scheduler).chunks] == [("short", 3)]
    scheduler.add(long)
    plans = [step(scheduler) for _ in range(10)]
    # while the short request decodes (7 more tokens) the long prompt advances 8 tokens a step; then, nothing
    # decoding, it takes the whole budget
    assert [[(c.seq.request_id, c.num_tokens) for c in p.chunks] for p in plans] == (
        [[("short", 1), ("long", 8)]] * 7 + [[("long", 64)], [("long", 64)], [("long", 16)]])
    assert short.is_finished and long.num_output_tokens == 1
    run_to_completion(scheduler, [long])
    assert kv.num_free_blocks == 256
    # without chunked prefill a whole prompt must fit one step: no cap applies
    whole = Scheduler(KVCacheManager(256, 4), max_batch_size=8, max_batch_input_tokens=64,
                      enable_chunked_prefill=False, max_prefill_tokens_beside_decodes=8)
    whole.add(make_seq("a", 3, 10))
    step(whole)
    whole.add(make_seq("b", 40, 2))
    assert [(c.seq.request_id, c.num_tokens) for c in step(whole).chunks] == [("a", 1), ("b", 40)]


def test_speculative_lookahead_reserves_blocks_and_respects_limits():
    """A decoding request that speculates gets K lookahead slots (blocks reserved, budget charged), fewer
    near its length limit or when the budget is short; one that does not speculate gets none."""
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(kv, max_batch_size=8, max_batch_input_tokens=18, num_lookahead_tokens=3)
    fast, near_end, plain = make_seq("fast", 6, 20), make_seq("near", 6, 3), make_seq("plain", 6, 20)
    fast.speculates = near_end.speculates = True
    for seq in (fast, near_end, plain):
        scheduler.add(seq)
    scheduler.update(scheduler.schedule(), [7, 7, 7])  # three prompts, one token each
    scheduler.max_batch_input_tokens = 9
    plan = scheduler.schedule()
    lookahead = {c.seq.request_id: c.num_lookahead for c in plan.chunks}
    # fast: 3; near: 6 + 3 tokens max, has 7, so one draft at most (it emits up to 2); plain: 0
    assert lookahead == {"fast": 3, "near": 1, "plain": 0}
    assert sum(1 + c.num_lookahead for c in plan.chunks) <= 9
    assert len(kv.block_table("fast")) == kv.num_blocks_for(6 + 1 + 3)
    short = Scheduler(KVCacheManager(64, 4), max_batch_size=8, max_batch_input_tokens=3, num_lookahead_tokens=3)
    seq = make_seq("short", 2, 20)
    seq.speculates = True
    short.add(seq)
    short.update(short.schedule(), [7])
    assert [c.num_lookahead for c in short.schedule().chunks] == [2]  # the budget of 3 allows 1 + 2
