"""scheduling_policy: fcfs (arrival order, the default) and priority (vLLM's: lower first, then arrival)
for admission and preemption; priority preemption keeps greedy outputs token-exact."""

from __future__ import annotations

import pytest

from tests.conftest import assert_no_leaks, greedy
from tests.pipeline.test_engine_exactness import make_prompts, record_preemptions
from tests.pipeline.test_scheduler import make_seq, step
from pipeline import LLM
from pipeline.kv_cache import KVCacheManager
from pipeline.scheduler import Scheduler
from pipeline.scheduling_policy import priority_key


def with_priority(seq, priority):
    seq.priority = priority
    return seq


def admission_order(policy: str, priorities: list[int]) -> list[str]:
    """Requests r0, r1, ... queued at once behind a one-row batch: the order they start running in."""
    scheduler = Scheduler(KVCacheManager(64, 4), max_batch_size=1, max_batch_input_tokens=64,
                          scheduling_policy=policy)
    for i, priority in enumerate(priorities):
        scheduler.add(with_priority(make_seq(f"r{i}", 3, 2), priority))
    started: list[str] = []
    while scheduler.num_unfinished:
        for chunk in step(scheduler).chunks:
            if chunk.start == 0:
                started.append(chunk.seq.request_id)
    assert scheduler.kv.num_free_blocks == 64
    return started


def test_fcfs_admits_in_arrival_order_whatever_the_priority():
    assert admission_order("fcfs", [5, 0, 5, -1, 0]) == ["r0", "r1", "r2", "r3", "r4"]


def test_priority_admits_the_lowest_value_first_then_by_arrival():
    assert admission_order("priority", [5, 0, 5, -1, 0]) == ["r3", "r1", "r4", "r0", "r2"]


def test_the_default_policy_is_fcfs():
    assert Scheduler(KVCacheManager(8, 4), max_batch_size=1, max_batch_input_tokens=8).order.policy.value == "fcfs"


def first_preempted(policy: str) -> str:
    """``low`` (priority 9) arrives first, ``high`` (0) second; both run and grow until the pool is empty."""
    kv = KVCacheManager(4, 2)  # 8 slots: two sequences of 3 prompt tokens fill them after a few tokens each
    scheduler = Scheduler(kv, max_batch_size=2, max_batch_input_tokens=64, scheduling_policy=policy)
    low, high = with_priority(make_seq("low", 3, 6), 9), with_priority(make_seq("high", 3, 6), 0)
    scheduler.add(low)
    scheduler.add(high)
    for _ in range(20):
        plan = step(scheduler)
        if plan.preempted:
            victim = plan.preempted[0]
            survivor = high if victim is low else low
            assert survivor in [c.seq for c in plan.chunks], "the survivor decodes in the step that preempted"
            return victim.request_id
    raise AssertionError("the pool was meant to run out")


def test_fcfs_preempts_the_latest_admitted():
    assert first_preempted("fcfs") == "high"


def test_priority_preempts_the_worst_priority_even_if_admitted_first():
    assert first_preempted("priority") == "low"


def test_priority_preempts_the_latest_arrival_among_equals_and_requeues_it_ahead_of_later_ones():
    kv = KVCacheManager(6, 2)
    scheduler = Scheduler(kv, max_batch_size=3, max_batch_input_tokens=64, scheduling_policy="priority")
    a, b, c = (with_priority(make_seq(name, 3, 8), 1) for name in "abc")
    late = with_priority(make_seq("late", 3, 2), 1)
    for seq in (a, b, c):
        scheduler.add(seq)
    victims = []
    for _ in range(40):
        plan = step(scheduler)
        victims += [s.request_id for s in plan.preempted]
        if victims:
            break
    assert victims[0] == "c"
    scheduler.add(late)  # arrives after the victim: waits behind it, although it was never preempted
    assert [s.request_id for s in scheduler.waiting][:2] == ["c", "late"]


def test_priority_orders_remote_prefill_reservations():
    scheduler = Scheduler(KVCacheManager(64, 4), max_batch_size=1, max_batch_input_tokens=64,
                          scheduling_policy="priority")
    for name, priority in (("a", 3), ("b", 1), ("c", 2)):
        scheduler.add_remote(with_priority(make_seq(name, 3, 2), priority))
    assert [s.request_id for s in scheduler.reserve_remote()] == ["b"]


@pytest.fixture(scope="module")
def prompts_and_reference(tiny_checkpoint):
    """Greedy outputs of a pool big enough for every request at once (nothing preempted)."""
    llm = LLM(model=tiny_checkpoint("llama"), kv_cache={"page_size": 2, "num_blocks": 256})
    prompts = make_prompts(llm.engine.vocab_size, lengths=[7, 13, 5, 11, 9, 3])
    preempted = record_preemptions(llm)
    reference = [out.token_ids for out in llm.generate(prompts, greedy(24))]
    assert not preempted
    return prompts, reference


def record_victims(llm: LLM) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Each preemption's (victim's key, the worst key running then)."""
    scheduler = llm.engine.scheduler
    victims = []
    original = scheduler._preempt

    def recording(seq, out):
        victims.append((priority_key(seq), max(priority_key(s) for s in scheduler.running)))
        original(seq, out)

    scheduler._preempt = recording
    return victims


@pytest.mark.parametrize("overlap", [False, True])
def test_priority_preemption_with_a_small_pool_keeps_outputs_token_exact(tiny_checkpoint, prompts_and_reference,
                                                                         overlap):
    prompts, reference = prompts_and_reference
    priorities = [3, 0, 5, 1, 5, 0]
    llm = LLM(model=tiny_checkpoint("llama"), scheduling_policy="priority", max_batch_input_tokens=16,
              enable_overlap_scheduler=overlap,
              kv_cache={"page_size": 2, "num_blocks": 40, "enable_prefix_caching": False})
    free_at_start = llm.engine.kv_manager.num_free_blocks
    victims = record_victims(llm)
    finished: list[str] = []
    outputs = llm.generate(prompts, greedy(24), priority=priorities,
                           on_finished=lambda out: finished.append(out.request_id))
    assert [out.token_ids for out in outputs] == reference
    assert victims, "the pool was meant to be too small for every request at once"
    assert all(victim == worst for victim, worst in victims), f"the worst running request gives way: {victims}"
    by_id = {out.request_id: level for out, level in zip(outputs, priorities)}
    assert sorted(by_id[rid] for rid in finished[:2]) == [0, 0], "the priority-0 requests finish first"
    assert_no_leaks(llm.engine.kv_manager, free_at_start)


def test_priority_list_must_match_the_prompts(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint("llama"), kv_cache={"page_size": 4, "num_blocks": 16})
    with pytest.raises(ValueError, match="priority"):
        llm.generate([[5, 6], [7, 8]], greedy(2), priority=[0])
