"""Prefix warm-ups (pipeline/prefix_warmup.py): a finished turn's prompt + answer computed into the prefix
cache in idle steps, so the next turn computes only what is new; warm-ups never delay, preempt or
starve real requests, and every block comes back."""

from __future__ import annotations

import pytest

from pipeline.config import PipelineConfig
from pipeline.engine import LLMEngine
from pipeline.kv_cache import KVCacheManager
from pipeline.prefix_warmup import MAX_QUEUED_WARMUPS, warmup_tokens
from pipeline.protocol import SamplingParams
from pipeline.scheduler import Scheduler
from pipeline.sequence import Sequence
from tests.conftest import assert_no_leaks, hf_greedy

PAGE = 4


def engine_for(path: str, num_blocks: int = 96, chunk: int = 5, **config) -> LLMEngine:
    return LLMEngine(PipelineConfig(model={"model_path": path}, max_batch_input_tokens=32,
                                    kv_cache={"page_size": PAGE, "num_blocks": num_blocks, "warmup_chunk_tokens": chunk},
                                    **config))


def run(engine: LLMEngine, request_id: str, prompt: list[int], max_tokens: int = 6, **kwargs) -> list:
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                       **kwargs)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def prefill_only(engine: LLMEngine, request_id: str, prompt: list[int]) -> None:
    """What a prefill worker does with a turn: compute the prompt, sample the first token, release the blocks."""
    run(engine, request_id, prompt, max_tokens=1, prefill_only=True)
    engine.kv.release_blocks(request_id)


def warm_until_idle(engine: LLMEngine) -> list:
    outputs = []
    while engine.scheduler.has_warmups:
        outputs += engine.step()
    return outputs


def test_warmup_tokens_keeps_full_blocks_and_one_never_computed():
    assert warmup_tokens(list(range(11)), 4) == [0, 1, 2, 3, 4, 5, 6, 7, 7]
    assert warmup_tokens(list(range(8)), 4) == [0, 1, 2, 3, 4, 5, 6, 7, 7]
    assert warmup_tokens(list(range(3)), 4) is None


@pytest.mark.parametrize("mode", ["plain", "overlap", "speculative"])
def test_next_turn_computes_only_the_new_message_and_matches_transformers(tiny_checkpoint, hf_reference, drafts,
                                                                          mode):
    """A prefill worker's view of a chat: it computed turn 1's prompt, never the answer (the decode
    worker did). After the warm-up, turn 2 finds prompt + answer cached and its greedy tokens are
    transformers' (with a draft model, the warm-up computes the draft's KV of those blocks too)."""
    path = tiny_checkpoint("llama")
    model, _ = hf_reference(path)
    extra = {"overlap": dict(enable_overlap_scheduler=True),
             "speculative": dict(draft_model={"model_path": drafts("llama", "small")},
                                 speculative={"num_speculative_tokens": 2})}.get(mode, {})
    engine = engine_for(path, **extra)
    free_at_start = engine.kv_manager.num_free_blocks
    prompt = list(range(20, 50))  # 30 tokens: 7 full blocks, 2 tokens in a partial one
    prefill_only(engine, "turn-1", prompt)
    answer = hf_greedy(model, prompt, 13)
    assert engine.warm_prefix(prompt + answer)
    assert warm_until_idle(engine) == []  # a warm-up never samples, so it emits nothing
    full = (len(prompt) + len(answer)) // PAGE * PAGE  # 40: blocks 7..9 were computed by the warm-up
    # ... from token 30 on: it took over turn 1's partial block 7, whose first 2 tokens' KV was written
    assert engine.num_warmup_tokens_computed == full - len(prompt)
    computed_before = engine.num_prompt_tokens_computed
    turn_2 = prompt + answer + [7, 8, 9, 10, 11]
    outputs = run(engine, "turn-2", turn_2)
    assert outputs[0].num_cached_tokens == full
    assert engine.num_prompt_tokens_computed - computed_before == len(turn_2) - full
    assert [t for o in outputs for t in o.new_token_ids] == hf_greedy(model, turn_2, 6)
    assert_no_leaks(engine.kv_manager, free_at_start)


def test_nothing_to_warm_when_the_cache_holds_it_or_it_fills_no_block(tiny_checkpoint):
    engine = engine_for(tiny_checkpoint("llama"))
    prompt = list(range(20, 36))
    prefill_only(engine, "r", prompt + [3])
    assert not engine.warm_prefix(prompt)  # every full block is cached already
    assert not engine.warm_prefix([5, 6, 7])  # no full block
    assert not engine.warm_prefix([10**6] * 8)  # not token ids of this model
    assert not engine.scheduler.has_warmups


def test_warmups_run_only_in_steps_with_nothing_else_and_in_small_chunks(tiny_checkpoint):
    engine = engine_for(tiny_checkpoint("llama"), chunk=3)
    free_at_start = engine.kv_manager.num_free_blocks
    assert engine.warm_prefix(list(range(100, 140)))
    engine.add_request("live", list(range(200, 223)), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests() or engine.scheduler.has_warmups:
        engine.step()
        chunks = engine.last_plan.chunks
        warm = [c for c in chunks if c.seq.is_warmup]
        assert not warm or len(chunks) == 1, "a warm-up shared a step with a request"
        assert all(c.num_tokens <= 3 for c in warm)
        assert not warm or not engine.has_unfinished_requests(), "a warm-up ran while a request had work"
    assert engine.num_warmup_tokens_computed == 40
    assert_no_leaks(engine.kv_manager, free_at_start)


def test_a_request_that_repeats_a_warmup_computes_it_instead(tiny_checkpoint):
    """The next turn arrived before the warm-up ran: it is dropped, not computed twice."""
    engine = engine_for(tiny_checkpoint("llama"))
    free_at_start = engine.kv_manager.num_free_blocks
    tokens = list(range(100, 140))
    assert engine.warm_prefix(tokens)
    engine.step()  # the warm-up's first chunk
    run(engine, "next-turn", tokens + [1, 2, 3])
    assert not engine.scheduler.has_warmups
    assert engine.num_warmup_tokens_computed == 5
    assert_no_leaks(engine.kv_manager, free_at_start)


def test_a_warmup_gives_its_blocks_to_a_request_that_needs_them(tiny_checkpoint, hf_reference):
    """A pool with room for the request or the warm-up, not both: the request runs (no preemption, the
    same tokens as transformers) and the warm-up is dropped."""
    path = tiny_checkpoint("llama")
    model, _ = hf_reference(path)
    engine = engine_for(path, num_blocks=12, chunk=4)
    free_at_start = engine.kv_manager.num_free_blocks
    assert engine.warm_prefix(list(range(100, 140)))  # 10 blocks
    engine.step()
    assert engine.scheduler.warmups.active is not None
    prompt = list(range(200, 225))
    outputs = run(engine, "live", prompt, max_tokens=8)
    assert [t for o in outputs for t in o.new_token_ids] == hf_greedy(model, prompt, 8)
    assert engine.scheduler.warmups.num_dropped == 1
    assert not engine.scheduler.has_warmups
    assert_no_leaks(engine.kv_manager, free_at_start)


def test_queued_warmups_are_bounded_oldest_first():
    kv = KVCacheManager(64, PAGE)
    scheduler = Scheduler(kv, max_batch_size=4, max_batch_input_tokens=16)
    seqs = [Sequence(f"w{i}", list(range(i, i + 9)), SamplingParams(max_tokens=1), 10)
            for i in range(MAX_QUEUED_WARMUPS + 3)]
    for seq in seqs:
        scheduler.add_warmup(seq)
    assert list(scheduler.warmups.queued) == seqs[3:]
    assert scheduler.warmups.num_dropped == 3
    assert scheduler.num_unfinished == 0  # warm-ups are not requests: a draining worker does not wait for them


def test_a_warmup_never_takes_the_last_batch_row(tiny_checkpoint):
    engine = engine_for(tiny_checkpoint("llama"), max_batch_size=1)
    free_at_start = engine.kv_manager.num_free_blocks
    assert engine.warm_prefix(list(range(100, 140)))
    engine.step()
    assert engine.scheduler.warmups.active is not None
    run(engine, "live", list(range(200, 210)))  # takes the one row: the warm-up gives way
    assert engine.scheduler.warmups.num_dropped == 1
    assert_no_leaks(engine.kv_manager, free_at_start)


def test_a_prefix_asked_for_twice_is_warmed_once_and_an_evicted_prompt_is_not_extended(tiny_checkpoint):
    engine = engine_for(tiny_checkpoint("llama"))
    shared = list(range(100, 124))
    assert engine.warm_prefix(shared) and not engine.warm_prefix(shared)
    assert not engine.warm_prefix(shared[:16])  # a prefix of one queued already
    warm_until_idle(engine)
    assert engine.num_warmup_tokens_computed == 24
    # the router says this worker computed 20 prompt tokens of this conversation, but its cache holds none
    # of them any more (evicted under pool pressure): warming it would evict more, so it is skipped
    assert not engine.warm_prefix(list(range(300, 340)), num_computed_here=20)
    assert engine.warm_prefix(list(range(100, 140)), num_computed_here=24)  # the prompt is still cached
