"""The overlap pipeline: the same tokens and logprobs with overlap on as off (and as transformers), and
MAX's contract for a step loop that returns the previous batch's outputs."""

from __future__ import annotations

import pytest
import torch

from pipeline import LLM, SamplingParams
from pipeline.config import PipelineConfig
from pipeline.engine import LLMEngine
from tests.conftest import ARCHITECTURES, assert_no_leaks, greedy, hf_greedy

PROMPT_LENGTHS = [3, 17, 5, 29, 11, 8, 23, 1]
NUM_NEW_TOKENS = 24
SMALL_STEPS = dict(max_batch_input_tokens=7, long_prefill_token_threshold=3,
                   kv_cache={"page_size": 2, "num_blocks": 48, "enable_prefix_caching": False})


def make_prompts(vocab_size: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def pair(path: str, **config) -> tuple[LLM, LLM]:
    """The same engine with overlap off and on."""
    return LLM(model=path, **config), LLM(model=path, enable_overlap_scheduler=True, **config)


def assert_same(off, on, logprob_tolerance: float = 0.0) -> None:
    """Same tokens, finish and text; logprobs equal, or within ``logprob_tolerance`` where the two runs
    batch differently: overlap sees a finish one step later, so that step runs one row more and the
    pool frees a step later (a prompt may be chunked at other boundaries); fp32 sums then move in the
    7th digit."""
    for i, (a, b) in enumerate(zip(off, on, strict=True)):
        assert b.token_ids == a.token_ids, f"request {i}: tokens differ with overlap on"
        assert (b.finish_reason, b.stop_reason, b.text) == (a.finish_reason, a.stop_reason, a.text), i
        if logprob_tolerance == 0.0 or a.logprobs is None:
            assert b.logprobs == a.logprobs, f"request {i}: logprobs differ with overlap on"
            continue
        for want, got in zip(a.logprobs, b.logprobs, strict=True):
            assert want.keys() == got.keys() or a.token_ids == b.token_ids
            assert all(abs(got[t] - value) <= logprob_tolerance for t, value in want.items() if t in got), i


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_overlap_is_token_exact_with_small_chunks_and_preemption(arch, tiny_checkpoint, hf_reference):
    """7-token steps, 2-token pages and a pool too small for the batch: chunked prefill and preemption
    by recompute while a step is in flight; transformers' greedy tokens, no block leaked."""
    path = tiny_checkpoint(arch)
    model, _ = hf_reference(path)
    prompts = make_prompts(model.config.vocab_size)
    off, on = pair(path, **SMALL_STEPS)
    preempted = []
    original = on.engine.scheduler._preempt
    on.engine.scheduler._preempt = lambda seq, out: (preempted.append(seq.request_id), original(seq, out))
    free_at_start = on.engine.kv_manager.num_free_blocks
    outputs = on.generate(prompts, greedy(NUM_NEW_TOKENS))
    assert preempted, "the pool was meant to be too small: no preemption happened"
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        assert out.token_ids == hf_greedy(model, prompt, NUM_NEW_TOKENS), f"prompt {i} diverged"
    assert_no_leaks(on.engine.kv_manager, free_at_start)
    assert_same(off.generate(prompts, greedy(NUM_NEW_TOKENS, logprobs=2)), on.generate(prompts, greedy(NUM_NEW_TOKENS, logprobs=2)),
                logprob_tolerance=1e-5)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_overlap_is_exact_on_prefix_cache_hits(arch, tiny_checkpoint):
    """Prompts sharing a 21-token prefix, sent twice: blocks are published one step late, hits the same."""
    path = tiny_checkpoint(arch)
    off, on = pair(path, kv_cache={"page_size": 4, "num_blocks": 128})
    shared = make_prompts(300, [21], seed=1)[0]
    prompts = [shared + tail for tail in make_prompts(300, [3, 9, 1, 6], seed=2)]
    first = on.generate(prompts, greedy(NUM_NEW_TOKENS, logprobs=1))
    second = on.generate(prompts, greedy(NUM_NEW_TOKENS, logprobs=1))
    assert_same(off.generate(prompts, greedy(NUM_NEW_TOKENS, logprobs=1)), first)
    assert_same(off.generate(prompts, greedy(NUM_NEW_TOKENS, logprobs=1)), second)  # both engines hit the cache now
    assert on.engine.kv_manager.num_free_blocks == on.engine.kv_manager.num_total_blocks


def test_seeded_sampling_and_every_logits_processor_are_identical(tiny_checkpoint):
    """Seeds draw by output position, so overlap changes nothing; penalties and bad words read the
    output so far, which makes the engine read the step in flight first (the drain path)."""
    roomy = dict(SMALL_STEPS, kv_cache={"page_size": 2, "num_blocks": 512})  # no preemption: the same batches
    off, on = pair(tiny_checkpoint("llama"), **roomy)
    prompts = make_prompts(300)
    cases = [
        SamplingParams(max_tokens=20, temperature=0.9, seed=11, top_p=0.9, logprobs=3),
        SamplingParams(max_tokens=20, temperature=0.9, seed=12, frequency_penalty=0.7, presence_penalty=0.3),
        SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3, min_tokens=5,
                       logit_bias={7: 5.0}, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.9, seed=13, bad_words=["a", "th"], stop=["e"]),
    ]
    for params in cases:  # a stop is seen one step late, so that step's batch has one row more: 1e-5
        assert_same(off.generate(prompts, params), on.generate(prompts, params), logprob_tolerance=1e-5)
    free = on.engine.kv_manager.num_free_blocks
    assert free == on.engine.kv_manager.num_total_blocks


# ------------------------------------------------------------------ the execute() contract
@pytest.fixture
def engine(tiny_checkpoint):
    config = PipelineConfig.load(overrides={"model": {"model_path": tiny_checkpoint("llama")},
                                            "kv_cache": {"page_size": 4, "num_blocks": 64},
                                            "enable_overlap_scheduler": True})
    return LLMEngine(config)


def run_until_idle(engine: LLMEngine) -> list[list]:
    """Every step's outputs as [(request id, tokens, finish reason)], until nothing is pending."""
    calls = []
    while engine.has_unfinished_requests():
        calls.append([(o.request_id, o.new_token_ids, o.finish_reason) for o in engine.step()])
    return calls


def test_first_call_returns_nothing_and_an_empty_call_drains(engine):
    engine.add_request("a", [5, 6, 7, 8, 9], greedy(max_tokens=4))
    assert not engine.has_pending_outputs()
    assert engine.step() == [] and engine.has_pending_outputs()  # the prefill is launched, not read
    calls = run_until_idle(engine)
    assert [len(c) for c in calls] == [1, 1, 1, 1]  # one token per call, one step late
    assert calls[-1][0][2] == "length" and not engine.has_pending_outputs()
    assert engine.last_plan is not None
    # the last call scheduled nothing (the request was at its length limit) and only drained
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks
    assert engine.step() == [] and not engine.has_pending_outputs()


def test_a_stop_seen_one_step_late_emits_no_extra_token(engine):
    engine.add_request("probe", [5, 6, 7, 8, 9], greedy(max_tokens=6))
    tokens = [t for call in run_until_idle(engine) for _, new, _ in call for t in new]
    engine.add_request("a", [5, 6, 7, 8, 9], greedy(max_tokens=6, stop_token_ids=[tokens[1]]))
    calls = run_until_idle(engine)
    emitted = [(new, finish) for call in calls for _, new, finish in call]
    assert emitted == [([tokens[0]], None), ([tokens[1]], "stop")]  # the step launched after it: dropped
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks


def test_abort_in_flight_frees_once_and_its_token_is_dropped(engine):
    total = engine.kv_manager.num_total_blocks
    engine.add_request("a", list(range(3, 40)), greedy(max_tokens=8))
    engine.add_request("b", [5, 6, 7], greedy(max_tokens=8))
    engine.step()
    engine.step()  # both decoding now, a step in flight
    assert engine.has_pending_outputs()
    assert engine.abort_request("a")
    used_by_b = len(engine.kv_manager.block_table("b"))
    assert engine.kv_manager.num_free_blocks == total - used_by_b  # a's blocks are free at once
    engine.add_request("a", [9, 9, 9], greedy(max_tokens=2))  # the id again, while its old step is in flight
    first = [(o.request_id, o.new_token_ids, o.finish_reason) for o in engine.step()]
    calls = [first, *run_until_idle(engine)]
    a_tokens = [t for call in calls for rid, new, _ in call if rid == "a" for t in new]
    assert len(a_tokens) == 2  # the new request's two tokens, none of the aborted one's
    assert engine.kv_manager.num_free_blocks == total
    assert not engine.has_pending_outputs()


def test_a_failed_step_leaves_no_step_in_flight_for_the_next_call(tiny_checkpoint):
    """A step that raises (a tensor-parallel collective, a kernel) while the next step, launched on its tokens, is
    in flight: the call fails with that error, and the next call runs clean (before, it read the stale step launched
    on the failed one's tokens and raised a TypeError)."""
    llm = LLM(model=tiny_checkpoint("llama"), enable_overlap_scheduler=True,
              kv_cache={"page_size": 4, "num_blocks": 64})
    runner = llm.engine.runner
    real_forward, calls = runner._forward, []

    def forward_failing_third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a collective failed")
        return real_forward(*args)

    runner._forward = forward_failing_third
    with pytest.raises(RuntimeError, match="a collective failed"):
        llm.generate([[5, 6, 7, 8, 9]], greedy(max_tokens=8))
    assert not llm.engine.has_pending_outputs()
    runner._forward = real_forward
    off = LLM(model=tiny_checkpoint("llama"), kv_cache={"page_size": 4, "num_blocks": 64})
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    assert [o.token_ids for o in llm.generate(prompts, greedy(max_tokens=8))] == \
        [o.token_ids for o in off.generate(prompts, greedy(max_tokens=8))]
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_total_blocks
