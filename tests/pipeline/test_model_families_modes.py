"""The mixture-of-experts, latent-attention and sliding-window families under the engine's other modes: chunked
prefill with preemption by recompute, the overlap scheduler, and speculative decoding (the target as its own
draft, and a one-layer truncation of it) — greedy tokens token for token transformers' own, fp32, CPU, no block
leaks. The dense families are held to the same in ``test_engine_exactness.py`` and ``test_speculative.py``;
this module runs those checks over Qwen3-MoE, Mixtral, Gemma 3, gpt-oss and DeepSeek-V3.
"""

from __future__ import annotations

import pytest

from bench.draft_checkpoint import truncated_copy
from pipeline import LLM
from tests.conftest import hf_greedy
from tests.deepseek_checkpoints import deepseek_checkpoint  # noqa: F401 (a fixture)
from tests.gemma_checkpoints import gemma3_checkpoint  # noqa: F401 (a fixture)
from tests.gpt_oss_checkpoints import gpt_oss_checkpoint  # noqa: F401 (a fixture)
from tests.moe_checkpoints import moe_checkpoint  # noqa: F401 (a fixture)
from tests.pipeline.test_engine_exactness import generate_and_check, make_prompts, record_preemptions

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
