"""Tensor parallelism for the mixture-of-experts families (pipeline/parallel): two rank processes, each holding a
slice of every expert's intermediate dimension, give transformers' fp32 tokens and logprobs (Qwen3-MoE, Mixtral,
gpt-oss; DeepSeek-V3: tests/pipeline/test_tensor_parallel_latent.py); the architectures and checkpoints it does not
run are refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipeline.parallel import TensorParallelError
from tests.conftest import check_greedy_and_logprobs
from tests.gpt_oss_checkpoints import gpt_oss_checkpoint  # noqa: F401 (a fixture)
from tests.moe_checkpoints import SPARSE_LAYERS, moe_checkpoint  # noqa: F401 (a fixture)
from tests.mxfp4_checkpoints import write_mxfp4
from tests.pipeline.test_tensor_parallel import PROMPTS, _descendants, tp_llm, wait_gone


def check_tp_moe(path: str, hf_model, num_new_tokens: int = 10, **overrides) -> None:
    """A TP 2 engine over ``path``: greedy tokens equal transformers', logprobs within 1e-4; its ranks gone after."""
    with tp_llm(path, **overrides) as llm:
        config = hf_model.config
        expert_size = config.moe_intermediate_size if config.model_type == "qwen3_moe" else config.intermediate_size
        experts = llm.engine.model.model.layers[-1].mlp.experts  # [experts, hidden, intermediate / 2] on rank 0
        assert experts.down_proj.shape[-1] == expert_size // 2
        if overrides.get("kernel_backend") == "cpu" and hasattr(experts, "expert_gemms"):
            assert experts.expert_gemms is not None  # packed per expert, as a single-process model's are
        check_greedy_and_logprobs(llm, hf_model, PROMPTS, num_new_tokens, atol=1e-4)
        pids = llm.engine.model.driver.pids
    assert wait_gone(pids) == []


@pytest.mark.parametrize("name, backend", [
    ("qwen3_moe", "cpu"),  # GQA 4:2; 8 experts, top-4 renormalised; layer 1 dense (mlp_only_layers)
    ("qwen3_moe_unnormed", "torch"),  # one KV head (replicated); top-4 of 10 unnormalised; layer 0 dense
    # (decoder_sparse_step); tied embeddings, a vocabulary of 301 that 2 does not divide
    ("mixtral", "cpu"),  # every layer sparse; top-2 of 8 with the routing weights in fp32
])
def test_moe_greedy_and_logprobs_match_transformers(name, backend, moe_checkpoint, hf_reference):  # noqa: F811
    path = moe_checkpoint(name)
    hf_model = hf_reference(path)[0]
    sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf_model.model.layers]
    assert sparse == SPARSE_LAYERS[name]  # the dense layers among sparse ones really are there
    check_tp_moe(path, hf_model, kernel_backend=backend)


@pytest.mark.parametrize("name, backend", [
    ("gpt_oss", "cpu"),  # GQA 4:2, sliding and full layers; biased router and experts; sinks; top-4 of 8
    ("gpt_oss_gqa4", "torch"),  # one KV head (replicated), the sinks of each rank's q heads; top-2 of 6
])
def test_gpt_oss_greedy_and_logprobs_match_transformers(name, backend, gpt_oss_checkpoint, hf_reference):  # noqa: F811
    path = gpt_oss_checkpoint(name)
    check_tp_moe(path, hf_reference(path)[0], kernel_backend=backend)


@pytest.fixture(scope="module")
def stacked_mixtral(tmp_path_factory, moe_checkpoint, hf_reference) -> str:  # noqa: F811
    """The Mixtral checkpoint re-saved with every layer's experts stacked (``experts.gate_up_proj``
    ``[experts, 2 * inter, hidden]``: each rank reads two row blocks of it, its gate rows and its up rows)."""
    source = Path(moe_checkpoint("mixtral"))
    path = tmp_path_factory.mktemp("tiny-mixtral-stacked")
    shutil.copytree(source, path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors*"))
    hf_reference(str(source))[0].save_pretrained(path, save_original_format=False)
    return str(path)


def test_stacked_expert_layout_matches_transformers(stacked_mixtral, moe_checkpoint, hf_reference):  # noqa: F811
    from safetensors import safe_open

    with safe_open(next(Path(stacked_mixtral).glob("*.safetensors")), "pt") as handle:
        assert "model.layers.0.mlp.experts.gate_up_proj" in handle.keys()
    check_tp_moe(stacked_mixtral, hf_reference(moe_checkpoint("mixtral"))[0], num_new_tokens=6)


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory) -> tuple[str, str]:
    """(gpt-oss with its experts in the hub's MXFP4 layout, the float checkpoint it was written from): an
    intermediate size of 64, so each of two ranks holds one whole 32-value block of every down_proj row."""
    from pipeline.builtin_model import build_checkpoint
    from tests.gpt_oss_checkpoints import GPT_OSS_CONFIGS

    root = tmp_path_factory.mktemp("tp-mxfp4")
    source = build_checkpoint(root / "float", "gpt_oss", **{**GPT_OSS_CONFIGS["gpt_oss"], "intermediate_size": 64})
    return str(write_mxfp4(source, root / "mxfp4")), str(source)


def test_mxfp4_gpt_oss_is_read_in_whole_blocks_per_rank(mxfp4_gpt_oss, hf_reference):
    """gpt-oss as the hub ships it: each rank reads its rows of gate_up_proj's blocks and its whole input blocks of
    down_proj's, dequantized at load. transformers dequantizes the same files on the CPU: its greedy tokens and
    logprobs (1e-4)."""
    path, _ = mxfp4_gpt_oss
    hf_model, _ = hf_reference(path)
    with tp_llm(path) as llm:
        experts = llm.engine.model.model.layers[0].mlp.experts
        assert experts.down_proj.shape[-1] == 32  # half of every expert's 64
        check_greedy_and_logprobs(llm, hf_model, PROMPTS, 10, atol=1e-4)
        pids = llm.engine.model.driver.pids
    assert wait_gone(pids) == []


def test_mxfp4_cuts_inside_a_block_are_refused_by_name(gpt_oss_checkpoint, tmp_path):  # noqa: F811
    """The tiny gpt-oss's intermediate size of 32 would leave each rank half a block of 32 inputs."""
    children_before = set(_descendants())
    with pytest.raises(TensorParallelError, match="not whole 32-value blocks"):
        tp_llm(str(write_mxfp4(gpt_oss_checkpoint("gpt_oss"), tmp_path / "mxfp4")))
    assert set(_descendants()) <= children_before  # refused before any rank was started


def test_an_architecture_with_no_shard_is_refused_by_name():
    """Every architecture Tandem runs has a shard; one added to the registry without one is refused, not split
    wrongly."""
    from types import SimpleNamespace

    from pipeline.parallel.shard_spec import check_supported

    config = SimpleNamespace(architectures=["Phi3ForCausalLM"], num_attention_heads=4)
    with pytest.raises(TensorParallelError, match="not supported for architecture Phi3ForCausalLM"):
        check_supported(config, 2, None, {})


@pytest.mark.parametrize("name, field, size", [
    ("qwen3_moe", "moe_intermediate_size", 33),  # the experts'
    ("qwen3_moe", "intermediate_size", 95),  # its dense layer's (mlp_only_layers)
    ("mixtral", "intermediate_size", 47),  # the experts'
])
def test_an_intermediate_size_two_ranks_cannot_split_is_named(name, field, size, moe_checkpoint):  # noqa: F811
    from pipeline.parallel.shard_spec import check_supported
    from pipeline.weights import load_hf_config

    hf_config = load_hf_config(moe_checkpoint(name))
    setattr(hf_config, field, size)
    with pytest.raises(TensorParallelError, match=f"tensor_parallel_size=2 must divide {field}={size}"):
        check_supported(hf_config, 2, None, {})
