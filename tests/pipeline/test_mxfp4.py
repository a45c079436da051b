"""gpt-oss as the hub ships it: MXFP4 experts (``tests/mxfp4_checkpoints.py`` writes them from a float checkpoint)
loaded through the real path, against transformers loading the same files with its own MXFP4 decoder."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline import LLM
from pipeline.checkpoint_errors import CheckpointError
from pipeline.quantization.mxfp4 import dequantize_mxfp4
from tests.conftest import assert_no_leaks, check_greedy_and_logprobs
from tests.gpt_oss_checkpoints import gpt_oss_checkpoint  # noqa: F401 (a fixture)
from tests.mxfp4_checkpoints import encode_mxfp4, write_mxfp4
from tests.pipeline.test_engine_exactness import make_prompts

ENGINE = dict(kv_cache={"page_size": 4, "num_blocks": 128})


@pytest.fixture(scope="module")
def mxfp4_checkpoint(gpt_oss_checkpoint, tmp_path_factory):
    cache: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in cache:
            cache[name] = str(write_mxfp4(gpt_oss_checkpoint(name), tmp_path_factory.mktemp(f"mxfp4-{name}") / "c"))
        return cache[name]

    return make


def test_dequantization_is_transformers_own():
    """Every e2m1 code in both nibbles, scales from 2^-20 to 2^10: the same floats as transformers' decoder."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(127 - 20, 127 + 11, (3, 40, 4), generator=generator, dtype=torch.uint8)
    ours = dequantize_mxfp4("w", blocks, scales)  # [3, 128, 40]
    assert ours.shape == (3, 128, 40)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))


def test_the_test_encoder_round_trips():
    weight = torch.randn(2, 24, 64) * 0.05
    blocks, scales = encode_mxfp4(weight)
    decoded = dequantize_mxfp4("w", blocks, scales).transpose(1, 2)  # back to [experts, rows, cols]
    again = dequantize_mxfp4("w", *encode_mxfp4(decoded)).transpose(1, 2)
    assert torch.equal(again, decoded)  # decoded values are representable: encoded again, they are kept exactly
    assert (decoded - weight).abs().max() <= weight.abs().max() / 4  # at most half of e2m1's widest step, 4 -> 6


@pytest.mark.parametrize("name", ["gpt_oss"])  # the gqa4 config's 48 / 40 are not multiples of 32
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_mxfp4_checkpoint_is_transformers_greedy_and_logprobs(name, backend, mxfp4_checkpoint, hf_reference):
    """The dequantized experts are exact (e2m1 times a power of two), so fp32 is token-exact as for float weights."""
    path = mxfp4_checkpoint(name)
    hf_model, _ = hf_reference(path)  # transformers dequantizes MXFP4 on the CPU itself
    llm = LLM(path, kernel_backend=backend, **ENGINE)
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float32
    free_at_start = llm.engine.kv_manager.num_free_blocks
    prompts = make_prompts(hf_model.config.vocab_size, [3, 17, 29], seed=11)  # past the windows (5, 8)
    check_greedy_and_logprobs(llm, hf_model, prompts, 10, 1e-4)
    assert_no_leaks(llm.engine.kv_manager, free_at_start)


def test_blocks_without_their_scales_are_named(mxfp4_checkpoint, tmp_path):
    path = tmp_path / "broken"
    shutil.copytree(mxfp4_checkpoint("gpt_oss"), path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_blocks but no "
                                               r"model\.layers\.1\.mlp\.experts\.down_proj_scales"):
        LLM(str(path), **ENGINE)
