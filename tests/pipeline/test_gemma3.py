"""Gemma 3 (text) against transformers: its local and global layers, logits over the paged cache, the offline engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline import LLM, SamplingParams
from pipeline.weights import CheckpointError, load_model
from tests.conftest import assert_no_leaks, check_cached_continuations, check_greedy_and_logprobs, hf_greedy
from tests.gemma_checkpoints import GEMMA3_CONFIGS, LOCAL_LAYERS, gemma3_checkpoint  # noqa: F401 (a fixture)
from tests.pipeline.test_engine_exactness import make_prompts
from tests.pipeline.test_models import KERNELS, bf16_logits, check_batch_over_cached_prefix, loaded_models
from tests.pipeline.test_prompt_logprobs import check_against_transformers

ATOL = 1e-4


@pytest.fixture(scope="module")
def loaded(gemma3_checkpoint, hf_reference):
    """``loaded(name, backend)`` -> (our fp32 model prepared for ``backend``, hf_config, transformers model)."""
    return loaded_models(gemma3_checkpoint, hf_reference)


@pytest.mark.parametrize("name", GEMMA3_CONFIGS)
def test_local_and_global_layers_where_transformers_has_them(loaded, name):
    """Local layers: the window and the local RoPE; global layers: the whole context and the global (scaled) RoPE."""
    model, hf_config, hf_model = loaded(name)
    windows = [layer.self_attn.sliding_window for layer in model.model.layers]
    assert windows == [layer.self_attn.sliding_window for layer in hf_model.model.layers]
    assert windows == [hf_config.sliding_window if is_local else None for is_local in LOCAL_LAYERS[name]]
    rotary = hf_model.model.rotary_emb
    for index, is_local in enumerate(LOCAL_LAYERS[name]):
        inv_freq = getattr(rotary, f"{'sliding' if is_local else 'full'}_attention_inv_freq")
        positions = torch.arange(hf_config.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        torch.testing.assert_close(model.cos_sin_cache_of(index), torch.cat((freqs.cos(), freqs.sin()), -1))


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", GEMMA3_CONFIGS)
def test_batch_over_cached_prefix_matches_transformers(loaded, name, backend):
    """Three sequences longer than the window prefilled together, continued over their cached prefixes, then
    decode steps, each step's logits within 1e-4 of transformers' and the same argmax."""
    model, hf_config, hf_model = loaded(name, backend)
    check_batch_over_cached_prefix(model, hf_config, hf_model, backend, [13, 22, 9], [5, 1, 12], num_decodes=3,
                                   seed=20, atol=ATOL)


@pytest.mark.parametrize("backend", KERNELS)
def test_bf16_is_as_close_to_transformers_bf16_as_bf16_is_to_fp32(gemma3_checkpoint, hf_reference, backend):
    """bf16 rounds differently in every implementation; ours must stay within bf16's own noise."""
    path = gemma3_checkpoint("gemma3")
    _, ours, theirs, exact = bf16_logits(path, hf_reference(path)[0], backend)
    assert (ours - theirs).abs().max().item() <= 2 * (theirs - exact).abs().max().item() + 1e-2


# --- configs that cannot be served ----------------------------------------------------------------


def test_bidirectional_attention_is_refused(tmp_path, gemma3_checkpoint):
    copy = Path(shutil.copytree(gemma3_checkpoint("gemma3"), tmp_path / "copy"))
    config = json.loads((copy / "config.json").read_text())
    config["use_bidirectional_attention"] = True
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="use_bidirectional_attention is not supported"):
        load_model(copy, torch.float32, "cpu")


# --- the offline engine ---------------------------------------------------------------------------

NUM_NEW_TOKENS = 12


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("name", GEMMA3_CONFIGS)
def test_llm_greedy_and_logprobs_match_transformers(name, backend, gemma3_checkpoint, hf_reference):
    """Prompts of 20-40 tokens (windows of 6 and 8), chunked prefill (16-token steps), prefix caching (a second
    round continues the first one's prompts), token-exact greedy output and logprobs within 1e-4; every
    block back afterwards."""
    path = gemma3_checkpoint(name)
    hf_model = hf_reference(path)[0]
    # transformers' generate() (min_new_tokens) never picks EOS and the engine with ignore_eos may: prompts whose
    # greedy continuations do not reach it
    prompts = make_prompts(hf_model.config.vocab_size, [23, 40, 3, 31, 20], seed=2)
    llm = LLM(model=path, kernel_backend=backend, max_batch_input_tokens=16,
              kv_cache={"page_size": 4, "num_blocks": 96, "enable_prefix_caching": True})
    free_at_start = llm.engine.kv_manager.num_free_blocks

    outs = check_greedy_and_logprobs(llm, hf_model, prompts, NUM_NEW_TOKENS, ATOL)

    again = [prompts[1] + outs[1].token_ids[:7], prompts[3] + [5, 6, 7]]  # their first blocks are cached
    check_cached_continuations(llm, hf_model, again, min_cached_tokens=40)
    assert_no_leaks(llm.engine.kv_manager, free_at_start)


def test_overlap_pipeline_and_prompt_logprobs_match_transformers(gemma3_checkpoint, hf_reference):
    """The overlap scheduler in 8-token chunks: greedy tokens and prompt logprobs (of softcapped logits) as transformers'."""
    path = gemma3_checkpoint("gemma3")
    hf_model = hf_reference(path)[0]
    prompts = make_prompts(hf_model.config.vocab_size, [21, 34, 2], seed=2)
    llm = LLM(model=path, enable_overlap_scheduler=True, max_batch_input_tokens=8,
              kv_cache={"page_size": 4, "num_blocks": 64})
    free_at_start = llm.engine.kv_manager.num_free_blocks
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=3))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf_model, prompt, 6)
        check_against_transformers(hf_model, prompt, out.prompt_logprobs, 3)
    assert_no_leaks(llm.engine.kv_manager, free_at_start)
