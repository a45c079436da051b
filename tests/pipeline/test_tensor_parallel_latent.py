"""Tensor parallelism for DeepSeek-V3 (multi-head latent attention, grouped-routed and shared experts, dense first
layers): two rank processes, each with half the heads' rows of the latent attention's q and kv_b_proj and their
o_proj columns, the latent projections and the latent cache whole, and a slice of every routed and shared expert,
give transformers' fp32 tokens and logprobs (1e-4); a W8A8 checkpoint runs int8 on both ranks within TP 1's bounds."""

from __future__ import annotations

import pytest

from pipeline.models.layers import Linear
from pipeline.quantization.int8 import Int8Linear
from tests.conftest import check_greedy_and_logprobs
from tests.deepseek_checkpoints import deepseek_checkpoint  # noqa: F401 (a fixture)
from tests.pipeline.test_quantization import sequences, teacher_forced_errors
from tests.pipeline.test_tensor_parallel import PROMPTS, tp_llm, wait_gone
from tests.quantized_checkpoints import quantized_checkpoint  # noqa: F401 (a fixture)


@pytest.mark.parametrize("name, backend", [
    ("deepseek_v3", "cpu"),  # q LoRA, interleaved rope; 4 heads (2 per rank); 1 dense layer, then experts
    ("deepseek_v3_yarn", "torch"),  # plain q_proj, yarn; 2 heads (1 per rank); 2 dense layers
])
def test_deepseek_v3_greedy_and_logprobs_match_transformers(name, backend, deepseek_checkpoint,  # noqa: F811
                                                            hf_reference):
    path = deepseek_checkpoint(name)
    hf_model, _ = hf_reference(path)
    config = hf_model.config
    with tp_llm(path, kernel_backend=backend) as llm:
        model = llm.engine.model
        attention = model.model.layers[0].self_attn
        latent_row = config.kv_lora_rank + config.qk_rope_head_dim
        assert attention.num_heads == config.num_attention_heads // 2
        kv_b_rows = config.qk_nope_head_dim + config.v_head_dim
        assert attention.kv_b_proj.weight.shape[0] == attention.num_heads * kv_b_rows
        assert attention.kv_a_proj_with_mqa.weight.shape[0] == latent_row  # whole
        assert llm.engine.kv_cache.shape[-1] == latent_row  # the whole latent row
        moe = model.model.layers[-1].mlp
        assert moe.experts.down_proj.shape[-1] == config.moe_intermediate_size // 2
        shared_size = config.moe_intermediate_size * config.n_shared_experts
        assert moe.shared_experts.down_proj.weight.shape[1] == shared_size // 2
        check_greedy_and_logprobs(llm, hf_model, PROMPTS, 10, atol=1e-4)
        pids = model.driver.pids
    assert wait_gone(pids) == []


def test_int8_deepseek_v3_on_two_ranks(deepseek_checkpoint, quantized_checkpoint, hf_reference):  # noqa: F811
    """kv_b_proj (read as weights, never called) stays a float Linear, sliced by heads; the rest runs int8."""
    quantized, reference = quantized_checkpoint("w8a8_int8_channel", deepseek_checkpoint("deepseek_v3"))
    with tp_llm(quantized) as llm:
        attention = llm.engine.model.model.layers[0].self_attn
        assert type(attention.kv_b_proj) is Linear and isinstance(attention.o_proj, Int8Linear)
        max_error, agreement = teacher_forced_errors(llm, hf_reference(reference)[0], sequences())
        # measured 0.625 / 97% (TP 1: 0.230 / 97%): each rank quantizes its own slice of o_proj's and down_proj's
        # input, which moves a near-tied sigmoid routing choice; with static per-tensor scales (the same on every
        # rank) TP 2 gives TP 1's 0.320 / 90%, so the slices themselves are exact
        assert max_error < 0.8 and agreement >= 0.9, (max_error, agreement)
