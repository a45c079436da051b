"""n > 1 and best_of in one engine: the prompt is computed once, every choice shares its full blocks, a
seeded choice draws the same tokens however it is run, and no block outlives the request."""

from __future__ import annotations

import pytest

from pipeline import LLM, SamplingParams
from pipeline.protocol.requests import choice_seed
from tests.conftest import assert_no_leaks, hf_greedy
from tests.pipeline.test_engine_exactness import make_prompts

PAGE = 4
CACHE = {"page_size": PAGE, "num_blocks": 256}


def sampled(max_tokens: int = 8, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=tiny_checkpoint("llama"), kv_cache=CACHE)


@pytest.fixture(autouse=True)
def no_leaks(llm):
    free = llm.engine.kv_manager.num_free_blocks
    yield
    assert_no_leaks(llm.engine.kv_manager, free)


def test_greedy_choices_are_all_transformers_greedy(llm, tiny_checkpoint, hf_reference):
    model, _ = hf_reference(tiny_checkpoint("llama"))
    prompts = make_prompts(model.config.vocab_size, [1, 7, 18])
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=3))
    for prompt, out in zip(prompts, outputs):
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert all(c.token_ids == hf_greedy(model, prompt, 6) for c in out.choices)


@pytest.mark.parametrize("length", [5, 8, 9])  # a partial last block, a full one, one token past it
def test_seeded_choice_i_is_the_same_alone_batched_and_as_its_own_request(llm, length):
    prompt = make_prompts(300, [length], seed=length)[0]
    many = llm.generate([prompt], sampled(n=4, seed=11))[0].choices
    assert len({tuple(c.token_ids) for c in many}) == 4  # different draws per choice
    others = make_prompts(300, [3, 12], seed=1)
    batched = llm.generate([others[0], prompt, others[1]], [sampled(), sampled(n=4, seed=11), sampled(n=2)])
    assert [c.token_ids for c in batched[1].choices] == [c.token_ids for c in many]
    for i, choice in enumerate(many):  # choice i is exactly a request seeded with choice_seed(seed, i)
        alone = llm.generate([prompt], sampled(seed=choice_seed(11, i)))[0]
        assert alone.token_ids == choice.token_ids


def test_the_prompt_is_computed_once_and_its_blocks_shared(llm):
    engine = llm.engine
    prompt = make_prompts(300, [18])[0]  # 4 full blocks + 2 tokens
    computed = []
    original = engine.runner.execute

    def counting(chunks, block_table):
        computed.extend((c.seq.request_id, c.start, c.num_tokens) for c in chunks)
        return original(chunks, block_table)

    engine.runner.execute = counting
    free = engine.kv_manager.num_free_blocks
    engine.add_request("r", prompt, sampled(max_tokens=8, n=4, seed=2))
    shared = (len(prompt) - 1) // PAGE  # 4 full blocks before the prompt's last token
    tables, peak = None, 0
    try:
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, free - engine.kv_manager.num_free_blocks)
            if tables is None and all(engine.kv_manager.has_sequence(f"r/{i}") for i in (1, 2, 3)):
                tables = [list(engine.kv_manager.block_table(rid)) for rid in ("r", "r/1", "r/2", "r/3")]
    finally:
        engine.runner.execute = original
    prompt_tokens = {rid: sum(n for r, start, n in computed if r == rid and start < len(prompt)) for rid, _, _ in computed}
    assert prompt_tokens["r"] == len(prompt)  # choice 0 computes the prompt; the others its last partial block
    assert all(prompt_tokens[f"r/{i}"] == len(prompt) - shared * PAGE for i in (1, 2, 3))
    assert all(table[:shared] == tables[0][:shared] for table in tables)  # the same blocks, held 4 times
    own = [set(table[shared:]) for table in tables]
    assert all(not (a & b) for i, a in enumerate(own) for b in own[i + 1:])  # past them, each its own
    per_choice = -(-(len(prompt) + 8 - 1) // PAGE)  # KV of the prompt and all but the last token
    assert peak <= shared + 4 * (per_choice - shared) < 4 * per_choice


def test_best_of_keeps_the_most_likely_candidates(llm):
    prompt = make_prompts(300, [10], seed=3)[0]
    out = llm.generate([prompt], sampled(n=2, best_of=5, seed=4))[0]
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].cumulative_logprob >= out.choices[1].cumulative_logprob
    everything = llm.generate([prompt], sampled(n=5, seed=4, logprobs=0))[0].choices
    best = sorted(everything, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in out.choices] == [c.token_ids for c in best]


def test_aborting_a_request_or_one_choice(llm):
    engine = llm.engine
    prompt = make_prompts(300, [13])[0]
    engine.add_request("a", prompt, sampled(max_tokens=20, n=3, seed=1))
    engine.step()  # choice 0's prompt: the others are forked now
    engine.step()
    assert engine.abort_choice("a", 1)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finish_reason is not None:
                finished[out.index] = out.request_finished
    assert finished == {0: finished[0], 2: finished[2]} and sum(finished.values()) == 1
    engine.add_request("b", prompt, sampled(max_tokens=20, n=4))
    engine.step()
    engine.step()
    assert engine.abort_request("b") and not engine.has_unfinished_requests()


@pytest.mark.parametrize("mode", ["overlap", "speculative"])
def test_other_modes_keep_seeded_choices(tiny_checkpoint, llm, mode):
    config = {"enable_overlap_scheduler": True} if mode == "overlap" else {
        "draft_model": {"model_path": None}, "speculative": {"num_speculative_tokens": 2}}
    other = LLM(model=tiny_checkpoint("llama"), kv_cache=CACHE, **config)
    prompt = make_prompts(300, [11], seed=5)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=3) if mode == "speculative" \
        else sampled(n=3, seed=9)
    want = [c.token_ids for c in llm.generate([prompt], params)[0].choices]
    free = other.engine.kv_manager.num_free_blocks
    assert [c.token_ids for c in other.generate([prompt], params)[0].choices] == want
    assert_no_leaks(other.engine.kv_manager, free)


def test_every_choice_keeps_its_own_constraint(llm):
    import re

    from pipeline.protocol import StructuredOutput

    spec = StructuredOutput(kind="regex", value=r"[0-9]{3}-[a-z]{2,4}")
    out = llm.generate([make_prompts(300, [6])[0]],
                       SamplingParams(max_tokens=20, temperature=1.0, seed=8, n=4, structured_output=spec))[0]
    texts = [c.text for c in out.choices]
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t) for t in texts), texts
    assert len(set(texts)) > 1


def test_choices_survive_preemption_in_a_small_pool(tiny_checkpoint, llm):
    """Choices preempted (their shared blocks released) and readmitted draw exactly the same tokens."""
    small = LLM(model=tiny_checkpoint("llama"), kv_cache={"page_size": PAGE, "num_blocks": 24})
    preempted = []
    original = small.engine.scheduler._preempt

    def counting(seq, out):
        preempted.append(seq.request_id)
        return original(seq, out)

    small.engine.scheduler._preempt = counting
    prompts = make_prompts(300, [13, 6], seed=7)
    params = sampled(max_tokens=14, n=3, seed=21)
    want = [[c.token_ids for c in out.choices] for out in llm.generate(prompts, params)]
    free = small.engine.kv_manager.num_free_blocks
    got = [[c.token_ids for c in out.choices] for out in small.generate(prompts, params)]
    assert preempted, "the pool was meant to be too small for every choice at once"
    assert got == want
    assert_no_leaks(small.engine.kv_manager, free)
