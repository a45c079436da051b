"""Gemma's ops (offset RMSNorm, GELU-tanh gated activation, the scaled embedding) bit-equal to transformers' modules,
in every kernel set; and a Gemma 3 checkpoint through the whole pipeline on the triton set."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, Gemma3TextScaledWordEmbedding

from kernels import TORCH_KERNELS, load_kernels
from kernels.gelu_and_mul_ref import gelu_tanh_and_mul_ref
from kernels.offset_rms_norm_ref import offset_rms_norm_ref
from pipeline import LLM, SamplingParams
from pipeline.models.layers import Embedding
from tests.conftest import assert_no_leaks, hf_greedy
from tests.gemma_checkpoints import gemma3_checkpoint  # noqa: F401 (a fixture)

KERNEL_SETS = ("torch", "cpu", "triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offset_rms_norm_is_gemma3_rmsnorm(dtype):
    generator = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(7, 48, generator=generator).to(dtype) for _ in range(2))
    norm = Gemma3RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=generator) * 0.3)
        norm.to(dtype)
        assert torch.equal(offset_rms_norm_ref(x, norm.weight, 1e-6), norm(x))
        out, summed = offset_rms_norm_ref(x, norm.weight, 1e-6, residual)
        assert torch.equal(summed, residual + x) and torch.equal(out, norm(residual + x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_is_transformers_gelu_pytorch_tanh(dtype):
    gate_up = torch.randn(9, 2 * 40, generator=torch.Generator().manual_seed(1)).to(dtype) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(gelu_tanh_and_mul_ref(gate_up), ACT2FN["gelu_pytorch_tanh"](gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_embedding_rounds_its_scale_as_transformers_does(dtype):
    hidden = 3072  # bf16 rounds sqrt(3072) = 55.43 to 55.5
    theirs = Gemma3TextScaledWordEmbedding(11, hidden, None, embed_scale=hidden**0.5).to(dtype)
    ours = Embedding(11, hidden, dtype, "cpu", scale=hidden**0.5)
    ids = torch.arange(11)
    with torch.no_grad():
        ours.weight.copy_(theirs.weight)
        assert torch.equal(ours(ids), theirs(ids))


@pytest.mark.parametrize("name", KERNEL_SETS)
def test_every_kernel_set_has_gemmas_ops(name):
    kernels = load_kernels(name, "cpu")
    generator = torch.Generator().manual_seed(2)
    x, residual, weight = torch.randn(5, 32, generator=generator), torch.randn(5, 32, generator=generator), torch.randn(32)
    for got, want in zip(kernels.offset_rms_norm(x, weight, 1e-6, residual), TORCH_KERNELS.offset_rms_norm(x, weight, 1e-6, residual)):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(kernels.gelu_tanh_and_mul(x), TORCH_KERNELS.gelu_tanh_and_mul(x))


def test_triton_backend_greedy_matches_transformers(gemma3_checkpoint, hf_reference):
    """Prompts longer than the local layers' window, chunked prefill, the triton set under the interpreter."""
    path = gemma3_checkpoint("gemma3")
    model = hf_reference(path)[0]
    prompts = [list(range(3, 23)), list(range(40, 54))]  # 20 and 14 tokens; window 8
    expected = [hf_greedy(model, prompt, 5) for prompt in prompts]
    llm = LLM(model=path, kernel_backend="triton", max_batch_input_tokens=12, kv_cache={"page_size": 4, "num_blocks": 24})
    assert llm.engine.kernels.name == "triton"
    free_at_start = llm.engine.kv_manager.num_free_blocks
    outputs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected
    assert_no_leaks(llm.engine.kv_manager, free_at_start)
