"""Tensor parallelism over quantized checkpoints (pipeline/parallel/shard_spec.py cuts each weight's scale with
it): two rank processes load int8 W8A8 and fp8 checkpoints written the way users download them, and
``--quantization int8``, against transformers running the dequantized weights in fp32.

fp8 runs dequantized on the CPU, so TP 2 gives the dequantized model's greedy tokens and logprobs (1e-4), as TP 1
does. int8 W8A8 quantizes activations per token: on a row-parallel layer (o_proj, down_proj) each rank quantizes
its own slice of a token, as vLLM's ranks do, so TP 2's values are not TP 1's; they are held to the bounds TP 1
is held to (tests/pipeline/test_quantization.py)."""

from __future__ import annotations

import pytest
import torch

from pipeline.parallel import TensorParallelError
from pipeline.parallel.shard_spec import Cut, ShardSpec
from pipeline.quantization.int8 import Int8Linear
from pipeline.quantization.int8_experts import Int8StackedExperts
from tests.conftest import check_greedy_and_logprobs
from tests.moe_checkpoints import moe_checkpoint  # noqa: F401 (a fixture)
from tests.pipeline.test_quantization import BOUNDS, MOE_INT8_BOUNDS, teacher_forced_errors, sequences
from tests.pipeline.test_tensor_parallel import PROMPTS, _descendants, tp_llm, wait_gone
from tests.quantized_checkpoints import quantized_checkpoint  # noqa: F401 (a fixture)


def check_closed(llm) -> None:
    pids = llm.engine.model.driver.pids
    llm.close()
    assert wait_gone(pids) == []


@pytest.mark.parametrize("scheme", ["fp8_channel_dynamic", "fp8_tensor_static", "fp8_block_whole"])
def test_fp8_checkpoints_give_the_dequantized_models_tokens(scheme, tiny_checkpoint, quantized_checkpoint,
                                                             hf_reference):
    """Per channel (each rank its rows' scales, o_proj and down_proj all of them), per tensor with static
    activation scales (whole on every rank), per 16x32 block (each rank its blocks)."""
    quantized, reference = quantized_checkpoint(scheme, tiny_checkpoint("llama"))
    llm = tp_llm(quantized)
    try:
        check_greedy_and_logprobs(llm, hf_reference(reference)[0], PROMPTS, 10, atol=1e-4)
    finally:
        check_closed(llm)


@pytest.mark.parametrize("scheme", ["w8a8_int8_channel", "w8a8_int8_tensor_static"])
def test_int8_checkpoints_run_int8_on_every_rank(scheme, tiny_checkpoint, quantized_checkpoint, hf_reference):
    quantized, reference = quantized_checkpoint(scheme, tiny_checkpoint("llama"))
    llm = tp_llm(quantized)
    try:
        attention = llm.engine.model.model.layers[0].self_attn
        assert isinstance(attention.qkv_proj, Int8Linear) and isinstance(attention.o_proj, Int8Linear)
        assert attention.qkv_proj.weight.shape[0] == (2 + 1 + 1) * 16  # rank 0's 2 q heads and 1 KV head of 16
        assert attention.o_proj.weight.shape[1] == 2 * 16  # its heads' input columns
        max_error, agreement = teacher_forced_errors(llm, hf_reference(reference)[0], sequences())
        bound, min_agreement = BOUNDS[scheme]
        assert max_error < bound and agreement >= min_agreement, (max_error, agreement)
    finally:
        check_closed(llm)


def test_load_time_int8_quantizes_each_ranks_shard(tiny_checkpoint, hf_reference):
    path = tiny_checkpoint("llama")
    llm = tp_llm(path, model_config={"dtype": "float32", "quantization": "int8"})
    try:
        assert isinstance(llm.engine.model.model.layers[0].mlp.down_proj, Int8Linear)
        max_error, agreement = teacher_forced_errors(llm, hf_reference(path)[0], sequences())
        assert max_error < 0.15 and agreement >= 0.85, (max_error, agreement)  # TP 1's bound
    finally:
        check_closed(llm)


def test_int8_moe_experts_are_sliced_and_run_int8(moe_checkpoint, quantized_checkpoint, hf_reference):  # noqa: F811
    quantized, reference = quantized_checkpoint("w8a8_int8_channel", moe_checkpoint("qwen3_moe"))
    llm = tp_llm(quantized)
    try:
        experts = llm.engine.model.model.layers[0].mlp.experts
        assert isinstance(experts, Int8StackedExperts) and experts.gate_up_t.dtype == torch.int8
        max_error, agreement = teacher_forced_errors(llm, hf_reference(reference)[0], sequences())
        assert max_error < MOE_INT8_BOUNDS["qwen3_moe"] and agreement >= 0.9, (max_error, agreement)
    finally:
        check_closed(llm)


def test_blocks_a_rank_would_cut_are_refused_before_any_rank_starts(tiny_checkpoint, quantized_checkpoint):
    """48-row blocks over q_proj's 64 rows: rank 0 would hold 32 rows, two thirds of a block."""
    children_before = set(_descendants())
    quantized, _ = quantized_checkpoint("fp8_block", tiny_checkpoint("llama"))
    with pytest.raises(TensorParallelError, match=r"q_proj.*not on the checkpoint's 48-wide quantization blocks"):
        tp_llm(quantized)
    assert set(_descendants()) <= children_before


def test_each_scale_is_cut_with_its_weight():
    from types import SimpleNamespace

    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=128,
                             vocab_size=307, model_type="llama")
    rank1 = ShardSpec.of(config, 1, 2)
    layer = "model.layers.0"
    assert rank1.slice_of(f"{layer}.self_attn.q_proj.weight_scale", (64, 1)) == Cut(0, ((32, 32),), 32)
    assert rank1.slice_of(f"{layer}.mlp.down_proj.weight_scale", (64, 1)) is None  # per output channel: all
    assert rank1.slice_of(f"{layer}.mlp.gate_proj.weight_scale", (1,)) is None  # per tensor
    assert rank1.slice_of(f"{layer}.self_attn.q_proj.input_scale", (1,)) is None
    blocked = ShardSpec.of(config, 1, 2, scale_block=(16, 32))
    assert blocked.slice_of(f"{layer}.self_attn.k_proj.weight_scale", (2, 2)) == Cut(0, ((1, 1),), 1)
    assert blocked.slice_of(f"{layer}.mlp.down_proj.weight_scale_inv", (4, 4)) == Cut(1, ((2, 2),), 2)
    with pytest.raises(TensorParallelError, match="not on the checkpoint's 48-wide"):
        ShardSpec.of(config, 1, 2, scale_block=(48, 40)).slice_of(f"{layer}.self_attn.q_proj.weight_scale", (2, 2))


@pytest.mark.parametrize("config_name, tp, refused", [
    ("deepseek_v3", 8, None),  # DeepSeek-V3's FP8 release: every cut of every split projection is whole blocks
    ("qwen3_moe", 2, None),  # Qwen3-30B-A3B-FP8: each expert's 768 columns -> 384, three blocks
    ("qwen3_moe", 4, "mlp.experts.0.gate_proj.weight_scale"),  # 192 columns: half a block
])
def test_released_block_fp8_shapes_split_on_whole_blocks(config_name, tp, refused):
    """The block check on the released models' own shapes (no weights): latent attention's q_b_proj, kv_b_proj and
    o_proj, the dense, routed and shared MLPs; not Llama's k/v projections, which latent attention has not."""
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    from pipeline.parallel.shard_spec import check_supported

    if config_name == "deepseek_v3":
        config = DeepseekV3Config(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                                  num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                                  kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                  n_routed_experts=256, n_shared_experts=1, first_k_dense_replace=3,
                                  vocab_size=129280, architectures=["DeepseekV3ForCausalLM"])
    else:
        config = Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                                num_experts_per_tok=8, vocab_size=151936, architectures=["Qwen3MoeForCausalLM"])
    fp8 = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                   "weight_block_size": [128, 128]}}
    if refused is None:
        check_supported(config, tp, None, fp8)
    else:
        with pytest.raises(TensorParallelError, match=refused):
            check_supported(config, tp, None, fp8)
