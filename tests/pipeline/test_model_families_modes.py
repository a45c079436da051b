"""The mixture-of-experts, latent-attention and sliding-window families under the engine's other modes: chunked
prefill with preemption by recompute, the overlap scheduler, speculative decoding (the target as its own
draft, and a one-layer truncation of it), n > 1 (choices forked from one prompt's KV), migration by replay (a
request resumed after its first tokens) and with its KV (paused on one engine, its cache rows copied, activated on
another), and structured output across both migrations — greedy tokens token for token transformers' own, the
others equal to the uninterrupted run, fp32, CPU, no block leaks. The dense families are held to the same in
``test_engine_exactness.py``, ``test_speculative.py``, ``test_resume.py`` and ``test_live_migration.py``; this module
runs those checks over Qwen3-MoE, Mixtral, Gemma 3, gpt-oss and DeepSeek-V3.
"""

from __future__ import annotations

import json

import pytest

from bench.draft_checkpoint import truncated_copy
from pipeline import LLM, SamplingParams
from pipeline.protocol import StructuredOutput
from tests.conftest import assert_no_leaks, hf_greedy
from tests.deepseek_checkpoints import deepseek_checkpoint  # noqa: F401 (a fixture)
from tests.gemma_checkpoints import gemma3_checkpoint  # noqa: F401 (a fixture)
from tests.gpt_oss_checkpoints import gpt_oss_checkpoint  # noqa: F401 (a fixture)
from tests.moe_checkpoints import moe_checkpoint  # noqa: F401 (a fixture)
from tests.pipeline.test_engine_exactness import generate_and_check, make_prompts, record_preemptions
from tests.pipeline.test_live_migration import decode_until, move_with_kv
from tests.pipeline.test_resume import SCHEMA, run

# family -> (the fixture that builds it, its name there)
FAMILIES = {
    "qwen3_moe": ("moe_checkpoint", "qwen3_moe"),
    "mixtral": ("moe_checkpoint", "mixtral"),
    "gemma3": ("gemma3_checkpoint", "gemma3"),
    "gpt_oss": ("gpt_oss_checkpoint", "gpt_oss"),
    "deepseek_v3": ("deepseek_checkpoint", "deepseek_v3"),
}
NUM_NEW_TOKENS = 16
PROMPT_LENGTHS = [3, 17, 5, 29, 11, 1]  # past the sliding windows (5-8 tokens) of the Gemma 3 / gpt-oss models
K = 3


@pytest.fixture(scope="module")
def family(request, hf_reference):
    """``family(name)`` -> (checkpoint path, prompts, transformers' greedy continuations), computed once."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            fixture, checkpoint_name = FAMILIES[name]
            path = request.getfixturevalue(fixture)(checkpoint_name)
            model, _ = hf_reference(path)
            prompts = make_prompts(model.config.vocab_size, PROMPT_LENGTHS, seed=5)
            cache[name] = (path, prompts, [hf_greedy(model, p, NUM_NEW_TOKENS) for p in prompts])
        return cache[name]

    return get


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_pages_small_chunks_and_preemption(name, family):
    """Page size 2, 7-token steps shared by several prompts (at most 3 tokens each), a pool too small for the
    batch: chunked prefill over sliding windows and latent caches, and preemption by recompute, change no token."""
    path, prompts, expected = family(name)
    llm = LLM(model=path, max_batch_input_tokens=7, long_prefill_token_threshold=3,
              kv_cache={"page_size": 2, "num_blocks": 40, "enable_prefix_caching": False})
    preempted = record_preemptions(llm)
    generate_and_check(llm, prompts, expected, NUM_NEW_TOKENS)
    assert preempted, "the pool was meant to be too small for the whole batch"


@pytest.mark.parametrize("name", FAMILIES)
def test_overlap_scheduler(name, family):
    path, prompts, expected = family(name)
    llm = LLM(model=path, enable_overlap_scheduler=True, max_batch_input_tokens=16,
              kv_cache={"page_size": 4, "num_blocks": 128})
    generate_and_check(llm, prompts, expected, NUM_NEW_TOKENS)


@pytest.fixture(scope="module")
def truncated_draft(family, tmp_path_factory):
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            path = tmp_path_factory.mktemp(f"draft-truncated-{name}")
            truncated_copy(family(name)[0], path, 1)
            cache[name] = str(path)
        return cache[name]

    return get


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("draft", ["self", "truncated"])
def test_speculative_decoding(name, draft, family, truncated_draft):
    """K tokens proposed a step, all verified in one target forward (K + 1 queries per sequence over the paged
    cache: the sliding windows, sinks and latent attention at several positions at once)."""
    path, prompts, expected = family(name)
    llm = LLM(model=path, draft_model={"model_path": truncated_draft(name) if draft == "truncated" else None},
              speculative={"num_speculative_tokens": K}, kv_cache={"page_size": 4, "num_blocks": 256})
    generate_and_check(llm, prompts, expected, NUM_NEW_TOKENS)
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0
    if draft == "self":
        assert stats.acceptance_rate == 1.0


@pytest.fixture(scope="module")
def engine_pair(family):
    """``engine_pair(name)`` -> two engines of the family's checkpoint (a stream's source and target)."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = tuple(LLM(model=family(name)[0], kv_cache={"page_size": 4, "num_blocks": 128})
                                for _ in range(2))
        return cache[name]

    return get


@pytest.mark.parametrize("name", FAMILIES)
def test_n_choices_share_their_prompt(name, family, engine_pair):
    """n = 3 greedy: choices 1 and 2 fork from choice 0's prompt KV (sliding-window and latent blocks shared), and
    every choice is transformers' greedy continuation."""
    path, prompts, expected = family(name)
    llm = engine_pair(name)[0]
    free = llm.engine.kv_manager.num_free_blocks
    outputs = llm.generate(prompts[:3], SamplingParams(n=3, temperature=0.0, max_tokens=NUM_NEW_TOKENS,
                                                       ignore_eos=True))
    for out, want in zip(outputs, expected):
        assert [choice.token_ids for choice in out.choices] == [want] * 3
    assert_no_leaks(llm.engine.kv_manager, free)


GRAMMAR = SamplingParams(max_tokens=48, temperature=1.0, seed=3,
                         structured_output=StructuredOutput(kind="json", value=json.dumps(SCHEMA)))


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("params", ["greedy", "grammar"])
def test_a_stream_migrates_by_replay_and_with_its_kv(name, params, family, engine_pair):
    """The same stream three ways: uninterrupted; resumed after its first 5 tokens on the other engine (replay:
    the prompt and those tokens recomputed); and paused after 5 tokens, its blocks' cache rows copied to the other
    engine and activated there (live KV move, nothing recomputed). All three are the same tokens; under a JSON
    schema, they parse."""
    path, prompts, expected = family(name)
    source, target = (llm.engine for llm in engine_pair(name))
    free = {engine: engine.kv_manager.num_free_blocks for engine in (source, target)}
    prompt = prompts[3]  # 29 tokens: past every sliding window
    sampling = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True) if params == "greedy" \
        else GRAMMAR
    whole = run(source, f"whole-{name}-{params}", prompt, sampling)
    if params == "greedy":
        assert whole == expected[3]
    replayed = run(target, f"replayed-{name}-{params}", prompt, sampling, resume=whole[:5])
    assert replayed == whole

    rid = f"moved-{name}-{params}"
    source.add_request(rid, prompt, sampling)
    sent = decode_until(source, rid, 5)
    steps, paused = source.pause_decoding()
    sent += [t for out in steps if out.request_id == rid for t in out.new_token_ids]
    (seq,) = paused
    assert sent + move_with_kv(source, target, seq, prompt, sampling, sent) == whole
    if params == "grammar":
        json.loads(target.tokenizer.decode(whole, skip_special_tokens=True))
    for engine, before in free.items():
        assert_no_leaks(engine.kv_manager, before)
