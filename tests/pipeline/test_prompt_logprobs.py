"""Prompt logprobs (vLLM's ``prompt_logprobs``) against transformers' log-softmax of its own forward:
every architecture, chunked prefill in small chunks, a prompt already in the prefix cache, the overlap
pipeline and speculative decoding."""

from __future__ import annotations

import pytest

from pipeline import LLM, SamplingParams
from tests.conftest import ARCHITECTURES, assert_no_leaks, hf_logprobs
from tests.pipeline.test_engine_exactness import make_prompts

TOLERANCE = 1e-4
LENGTHS = [1, 2, 9, 37, 20]


def params(num_top: int = 3) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=num_top)


def check_against_transformers(model, prompt: list[int], got: list[dict[int, float] | None], num_top: int) -> None:
    assert len(got) == len(prompt)
    assert got[0] is None
    want = hf_logprobs(model, prompt)  # [len, vocab]: row p predicts token p + 1
    for position in range(1, len(prompt)):
        row = want[position - 1]
        entry = got[position]
        token = prompt[position]
        assert abs(entry[token] - row[token].item()) < TOLERANCE, f"position {position}"
        top_values, top_ids = row.topk(num_top)
        for token_id, value in zip(top_ids.tolist(), top_values.tolist()):
            # near-ties may swap places between two correct implementations: compare by value
            if token_id in entry:
                assert abs(entry[token_id] - value) < TOLERANCE
        assert len(entry) in (num_top, num_top + 1)
        kth = top_values[-1].item() if num_top else float("inf")
        assert all(v >= kth - TOLERANCE for t, v in entry.items() if t != token)


def run_and_check(llm: LLM, model, prompts, num_top: int = 3) -> None:
    free_at_start = llm.engine.kv_manager.num_free_blocks
    outputs = llm.generate(prompts, params(num_top))
    for prompt, out in zip(prompts, outputs):
        check_against_transformers(model, prompt, out.prompt_logprobs, num_top)
    assert_no_leaks(llm.engine.kv_manager, free_at_start)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prompt_logprobs_match_transformers_in_small_chunks(arch, tiny_checkpoint, hf_reference):
    model, _ = hf_reference(tiny_checkpoint(arch))
    llm = LLM(model=tiny_checkpoint(arch), max_batch_input_tokens=8, enable_chunked_prefill=True,
              kv_cache={"page_size": 4, "num_blocks": 256})
    run_and_check(llm, model, make_prompts(model.config.vocab_size, LENGTHS))


def test_a_cached_prefix_is_computed_again_for_its_logprobs(tiny_checkpoint, hf_reference):
    model, _ = hf_reference(tiny_checkpoint("llama"))
    llm = LLM(model=tiny_checkpoint("llama"), kv_cache={"page_size": 4, "num_blocks": 256})
    prompt = make_prompts(model.config.vocab_size, [30])[0]
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))  # fills the prefix cache
    again = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
    assert again[0].prompt_logprobs is None
    run_and_check(llm, model, [prompt], num_top=0)


def test_rank_and_zero_top(tiny_checkpoint, hf_reference):
    model, _ = hf_reference(tiny_checkpoint("qwen2"))
    llm = LLM(model=tiny_checkpoint("qwen2"), kv_cache={"page_size": 4, "num_blocks": 256})
    prompt = make_prompts(model.config.vocab_size, [12])[0]
    engine = llm.engine
    engine.add_request("r", prompt, params(num_top=0))
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert first is None, "sent once"
                first = out.prompt_logprobs
    want = hf_logprobs(model, prompt)
    assert len(first) == len(prompt) - 1 and all(top == [] for top in first.top)
    for i, rank in enumerate(first.ranks):
        row = want[i]
        assert rank == int((row > row[prompt[i + 1]]).sum()) + 1


def test_overlap_and_speculation_keep_them(tiny_checkpoint, hf_reference):
    model, _ = hf_reference(tiny_checkpoint("llama"))
    prompts = make_prompts(model.config.vocab_size, LENGTHS)
    path = tiny_checkpoint("llama")
    cache = {"page_size": 4, "num_blocks": 256}
    run_and_check(LLM(model=path, enable_overlap_scheduler=True, max_batch_input_tokens=8, kv_cache=cache),
                  model, prompts)
    run_and_check(LLM(model=path, draft_model={"model_path": None}, speculative={"num_speculative_tokens": 2},
                      max_batch_input_tokens=8, kv_cache=cache), model, prompts)


def test_generation_is_unchanged_by_asking(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint("mistral"), kv_cache={"page_size": 4, "num_blocks": 256})
    prompts = make_prompts(300, LENGTHS)
    plain = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    scored = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=2))
    assert [o.token_ids for o in plain] == [o.token_ids for o in scored]


def test_bad_prompt_logprobs_is_clear():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
