"""gpt-oss against transformers: attention sinks on sliding and full layers, the router and clamped-SwiGLU
experts, logits over the paged cache, the offline engine."""

from __future__ import annotations

import pytest
import torch

from pipeline import LLM
from tests.conftest import assert_no_leaks, check_cached_continuations, check_greedy_and_logprobs
from tests.gpt_oss_checkpoints import GPT_OSS_CONFIGS, SLIDING_LAYERS, gpt_oss_checkpoint  # noqa: F401 (a fixture)
from tests.pipeline.test_engine_exactness import make_prompts
from tests.pipeline.test_models import KERNELS, bf16_logits, check_batch_over_cached_prefix, loaded_models

ATOL = 1e-4


@pytest.fixture(scope="module")
def loaded(gpt_oss_checkpoint, hf_reference):
    """``loaded(name, backend)`` -> (our fp32 model prepared for ``backend``, hf_config, transformers model)."""
    return loaded_models(gpt_oss_checkpoint, hf_reference)


@pytest.mark.parametrize("name", GPT_OSS_CONFIGS)
def test_windows_sinks_and_rope_where_transformers_has_them(loaded, name):
    model, hf_config, hf_model = loaded(name)
    windows = [layer.self_attn.sliding_window for layer in model.model.layers]
    assert windows == [layer.self_attn.sliding_window for layer in hf_model.model.layers]
    assert windows == [hf_config.sliding_window if is_sliding else None for is_sliding in SLIDING_LAYERS[name]]
    for ours, theirs in zip(model.model.layers, hf_model.model.layers):
        assert torch.equal(ours.self_attn.sinks, theirs.self_attn.sinks)
        assert theirs.self_attn.sinks.abs().min() > 0
    rotary = hf_model.model.rotary_emb
    assert rotary.rope_type == "yarn" and rotary.attention_scaling != 1.0
    positions = torch.arange(hf_config.max_position_embeddings)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)  # [1, max_positions, head_dim / 2] each
    torch.testing.assert_close(model.cos_sin_cache, torch.cat((cos[0], sin[0]), -1), atol=0, rtol=0)


@pytest.mark.parametrize("name", GPT_OSS_CONFIGS)
def test_moe_block_is_transformers_mlp(loaded, name):
    """Router (bias, top-k, softmax of the selected logits) and experts (interleaved gate/up stored transposed,
    biases, the clamped SwiGLU) against transformers' GptOssMLP, on inputs that cross the clamp limit."""
    model, hf_config, hf_model = loaded(name)
    hidden = torch.randn(37, hf_config.hidden_size, generator=torch.Generator().manual_seed(3)) * 2
    for ours, theirs in zip(model.model.layers, hf_model.model.layers):
        with torch.no_grad():
            expected, _ = theirs.mlp(hidden[None])
            gate_up = hidden @ theirs.mlp.experts.gate_up_proj[0] + theirs.mlp.experts.gate_up_proj_bias[0]
        assert (gate_up.abs() > hf_config.swiglu_limit).float().mean() > 0.1  # the clamps act on this input
        got = ours.mlp(hidden, KERNELS["torch"])
        torch.testing.assert_close(got, expected[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", GPT_OSS_CONFIGS)
def test_batch_over_cached_prefix_matches_transformers(loaded, name, backend):
    """Three sequences longer than the window prefilled together, continued over their cached prefixes, then
    decode steps, each step's logits within 1e-4 of transformers' and the same argmax."""
    model, hf_config, hf_model = loaded(name, backend)
    check_batch_over_cached_prefix(model, hf_config, hf_model, backend, [13, 22, 9], [5, 1, 12], num_decodes=3,
                                   seed=20, atol=ATOL)


NUM_NEW_TOKENS = 12


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("name", GPT_OSS_CONFIGS)
def test_llm_greedy_and_logprobs_match_transformers(name, backend, gpt_oss_checkpoint, hf_reference):
    """Prompts of up to 40 tokens (windows of 5 and 8), chunked prefill (16-token steps), prefix caching (a second
    round continues the first one's prompts), token-exact greedy output and logprobs within 1e-4; every block
    back afterwards."""
    path = gpt_oss_checkpoint(name)
    hf_model = hf_reference(path)[0]
    prompts = make_prompts(hf_model.config.vocab_size, [23, 40, 3, 31, 20], seed=2)
    llm = LLM(model=path, kernel_backend=backend, max_batch_input_tokens=16,
              kv_cache={"page_size": 4, "num_blocks": 96, "enable_prefix_caching": True})
    free_at_start = llm.engine.kv_manager.num_free_blocks

    outs = check_greedy_and_logprobs(llm, hf_model, prompts, NUM_NEW_TOKENS, ATOL)

    again = [prompts[1] + outs[1].token_ids[:7], prompts[3] + [5, 6, 7]]  # their first blocks are cached
    check_cached_continuations(llm, hf_model, again, min_cached_tokens=40)
    assert_no_leaks(llm.engine.kv_manager, free_at_start)


@pytest.mark.parametrize("backend", KERNELS)
def test_bf16_is_as_close_to_transformers_bf16_as_bf16_is_to_fp32(gpt_oss_checkpoint, hf_reference, backend):
    """bf16 rounds differently in every implementation (transformers also keeps gpt-oss's norms in fp32); ours
    must stay within bf16's own noise."""
    path = gpt_oss_checkpoint("gpt_oss")
    _, ours, theirs, exact = bf16_logits(path, hf_reference(path)[0], backend)
    assert (ours - theirs).abs().max().item() <= 2 * (theirs - exact).abs().max().item() + 1e-2
