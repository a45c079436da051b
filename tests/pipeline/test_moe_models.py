"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers: routing, logits, the offline engine."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.moe_ref import fused_moe_ref
from pipeline import LLM
from pipeline.builtin_model import build_checkpoint
from pipeline.models.moe import SparseMoeBlock, route
from pipeline.weights import CheckpointError, iter_safetensors, load_model
from tests.conftest import assert_no_leaks, check_cached_continuations, check_greedy_and_logprobs
from tests.moe_checkpoints import MOE_CONFIGS, SPARSE_LAYERS, moe_checkpoint  # noqa: F401 (a fixture)
from tests.pipeline.test_engine_exactness import make_prompts
from tests.pipeline.test_models import (
    KERNELS,
    PagedSequences,
    check_batch_over_cached_prefix,
    hf_logits,
    loaded_models,
    random_tokens,
    rewrite_weights,
    run_logits,
)

ATOL = 1e-4


@pytest.fixture(scope="module")
def loaded(moe_checkpoint, hf_reference):
    """``loaded(name, backend)`` -> (our fp32 model prepared for ``backend``, hf_config, transformers model)."""
    return loaded_models(moe_checkpoint, hf_reference)


# --- the building blocks ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_routing_is_transformers_router(loaded, name, dtype):
    """Same experts and the same weights, bit for bit, in transformers' dtype (Qwen3-MoE: the model's; Mixtral: fp32)."""
    model, hf_config, hf_model = loaded(name)
    index = SPARSE_LAYERS[name].index(True)
    ours = model.model.layers[index].mlp
    theirs = copy.deepcopy(hf_model.model.layers[index].mlp.gate).to(dtype)  # the shared model stays fp32
    hidden = torch.randn(37, hf_config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        _, want_weights, want_ids = theirs(hidden)
        weights, ids = route(F.linear(hidden, ours.gate.weight.to(dtype)), ours.spec)
    assert torch.equal(ids, want_ids)
    assert weights.dtype == want_weights.dtype and torch.equal(weights, want_weights)


def test_grouped_experts_equal_the_per_token_definition():
    """The grouped reference against the plain definition: each token through each of its experts, weighted."""
    generator = torch.Generator().manual_seed(0)
    num_tokens, hidden, intermediate, num_experts, top_k = 19, 32, 24, 6, 3
    x = torch.randn(num_tokens, hidden, generator=generator)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) * 0.2
    down = torch.randn(num_experts, hidden, intermediate, generator=generator) * 0.2
    weights, ids = torch.softmax(torch.randn(num_tokens, num_experts, generator=generator), -1).topk(top_k)
    ids[:, 0] = 2  # one expert over every token, some experts unused
    expected = torch.zeros_like(x)
    for t in range(num_tokens):
        for j in range(top_k):
            gate, up = (gate_up[ids[t, j]] @ x[t]).chunk(2)
            expected[t] += weights[t, j] * (down[ids[t, j]] @ (F.silu(gate) * up))
    torch.testing.assert_close(fused_moe_ref(x, gate_up, down, weights, ids), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_sparse_and_dense_layers_where_transformers_has_them(loaded, name):
    model, _, hf_model = loaded(name)
    kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert kinds == SPARSE_LAYERS[name]
    assert kinds == [hasattr(layer.mlp, "experts") for layer in hf_model.model.layers]


# --- logits against transformers ------------------------------------------------------------------


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_batch_over_cached_prefix_matches_transformers(loaded, name, backend):
    """Three sequences prefilled together, continued over their cached prefixes, then one decode step."""
    model, hf_config, hf_model = loaded(name, backend)
    check_batch_over_cached_prefix(model, hf_config, hf_model, backend, [9, 14, 5], [3, 1, 4], atol=ATOL)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_sliding_window_matches_transformers(tmp_path, hf_reference, name):
    """Both families window every layer when the config asks (Qwen3-MoE: use_sliding_window)."""
    architecture, settings = MOE_CONFIGS[name]
    window = dict(sliding_window=5, **({"use_sliding_window": True} if architecture == "qwen3_moe" else {}))
    path = str(build_checkpoint(tmp_path, architecture, **settings, **window))
    model, hf_config = load_model(path, torch.float32, "cpu")
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [5] * hf_config.num_hidden_layers
    tokens = random_tokens(hf_config.vocab_size, 18, seed=3)
    paged = PagedSequences(model, num_seqs=1, max_len=len(tokens))
    logits = torch.cat([run_logits(model, paged, [tokens[:15]]), run_logits(model, paged, [tokens[15:]])])
    torch.testing.assert_close(logits, hf_logits(hf_reference(path)[0], tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_stacked_expert_layout_loads_the_same_weights(tmp_path, loaded, name):
    """transformers can also save the experts as stacked tensors (``save_original_format=False``)."""
    reference, _, hf_model = loaded(name)
    hf_model.save_pretrained(tmp_path, save_original_format=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(iter_safetensors(tmp_path))

    model, _ = load_model(tmp_path, torch.float32, "cpu")

    for (key, param), (ref_key, ref_param) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert key == ref_key and torch.equal(param, ref_param), key


# --- checkpoints that cannot be used ---------------------------------------------------------------


@pytest.fixture
def mixtral_copy(tmp_path, moe_checkpoint) -> Path:
    return Path(shutil.copytree(moe_checkpoint("mixtral"), tmp_path / "copy"))


def test_missing_expert_tensor_is_named_as_the_checkpoint_names_it(mixtral_copy):
    name = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    rewrite_weights(mixtral_copy, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"missing tensor\(s\): {name.replace('.', '[.]')}$"):
        load_model(mixtral_copy, torch.float32, "cpu")


def test_expert_beyond_the_config_is_unexpected(mixtral_copy):
    rewrite_weights(mixtral_copy, lambda t: t.update(
        {"model.layers.0.block_sparse_moe.experts.8.w1.weight": torch.zeros(48, 64)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.0\.block_sparse_moe\.experts\.8"):
        load_model(mixtral_copy, torch.float32, "cpu")


def test_unsupported_architecture_lists_the_moe_ones(mixtral_copy):
    config = json.loads((mixtral_copy / "config.json").read_text())
    config["architectures"] = ["JambaForCausalLM"]
    (mixtral_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unsupported architecture JambaForCausalLM; supported: .*"
                       "Qwen3MoeForCausalLM, MixtralForCausalLM"):
        load_model(mixtral_copy, torch.float32, "cpu")


# --- the offline engine ---------------------------------------------------------------------------

NUM_NEW_TOKENS = 12


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_llm_greedy_and_logprobs_match_transformers(name, backend, moe_checkpoint, hf_reference):
    """Chunked prefill (16-token steps), prefix caching (a second round continues the first one's
    prompts), token-exact greedy output and logprobs within 1e-4; every block back afterwards."""
    path = moe_checkpoint(name)
    hf_model = hf_reference(path)[0]
    prompts = make_prompts(hf_model.config.vocab_size, [3, 29, 8, 1, 17], seed=1)
    llm = LLM(model=path, kernel_backend=backend, max_batch_input_tokens=16,
              kv_cache={"page_size": 4, "num_blocks": 96, "enable_prefix_caching": True})
    free_at_start = llm.engine.kv_manager.num_free_blocks

    outs = check_greedy_and_logprobs(llm, hf_model, prompts, NUM_NEW_TOKENS, ATOL)

    again = [prompts[1] + outs[1].token_ids[:7], prompts[4] + [5, 6, 7]]  # their first blocks are cached
    check_cached_continuations(llm, hf_model, again, min_cached_tokens=8)
    assert_no_leaks(llm.engine.kv_manager, free_at_start)
