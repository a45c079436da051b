"""Quantized layers and checkpoints on a CUDA device (``pytest -m gpu tests/gpu``; run by ``make gpu-check``).

On the CPU, int8 W8A8 runs through oneDNN and fp8 checkpoints are dequantized at load; on a GPU, int8 runs
through cuBLASLt (``torch._int_mm``, padded past its 16-row minimum) and fp8 through ``torch._scaled_mm`` on
Hopper or newer. These are the CPU suite's checks (``tests/pipeline/test_quantization.py``: each layer against
its own integer / scaled arithmetic, each checkpoint teacher-forced against transformers running the
dequantized weights in fp32) with the engine on the GPU, under the same bounds. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from pipeline import LLM
from pipeline.quantization.fp8 import fp8_gemm_available
from tests.pipeline.test_quantization import (
    BOUNDS,
    FP8_GEMM_BOUNDS,
    fp8_layer_and_exact,
    int8_layer_and_exact,
    linear_kinds,
    sequences,
    teacher_forced_errors,
)
from tests.quantized_checkpoints import quantized_checkpoint  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = "cuda"
ENGINE = dict(model_config={"device": DEVICE}, kv_cache={"page_size": 4, "num_blocks": 96})
needs_fp8_gemm = pytest.mark.skipif(not torch.cuda.is_available() or not fp8_gemm_available(DEVICE),
                                    reason="fp8 GEMMs need compute capability 9.0 (Hopper) or newer")


@pytest.mark.parametrize("num_tokens", [1, 7, 16, 17, 64])  # below, at and past cuBLASLt's 16-row minimum
def test_int8_linear_on_cuda_is_its_integer_arithmetic(num_tokens):
    layer, x, exact = int8_layer_and_exact(num_tokens, DEVICE, seed=num_tokens)
    got = layer(x.to(DEVICE))
    assert got.device.type == DEVICE and got.shape == (num_tokens, 96)
    torch.testing.assert_close(got.double().cpu(), exact, rtol=1e-5, atol=1e-4)


@needs_fp8_gemm
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_fp8_linear_on_cuda_is_its_scaled_product(num_tokens):
    layer, x, exact = fp8_layer_and_exact(num_tokens, DEVICE, seed=num_tokens)
    torch.testing.assert_close(layer(x.to(DEVICE)).double().cpu(), exact, rtol=1e-2, atol=1e-2)  # one bf16 rounding


@pytest.mark.parametrize("scheme", ["w8a8_int8_channel", "w8a8_int8_tensor_static"])
def test_int8_checkpoint_on_cuda_matches_the_dequantized_model(scheme, tiny_checkpoint, quantized_checkpoint,
                                                               hf_reference):
    quantized, reference = quantized_checkpoint(scheme, tiny_checkpoint("llama"))
    hf_model, _ = hf_reference(reference)
    llm = LLM(quantized, **ENGINE)
    assert linear_kinds(llm) == {"Int8Linear"}
    assert llm.engine.model.model.layers[0].self_attn.qkv_proj.weight_t.is_cuda
    max_error, agreement = teacher_forced_errors(llm, hf_model, sequences())
    bound, min_agreement = BOUNDS[scheme]
    assert max_error < bound and agreement >= min_agreement, (max_error, agreement)


def test_load_time_int8_on_cuda_agrees_with_the_float_model(tiny_checkpoint, hf_reference):
    path = tiny_checkpoint("llama")
    hf_model, _ = hf_reference(path)
    llm = LLM(path, model_config={"device": DEVICE, "quantization": "int8"},
              kv_cache=ENGINE["kv_cache"])
    assert linear_kinds(llm) == {"Int8Linear"}
    max_error, agreement = teacher_forced_errors(llm, hf_model, sequences())
    assert max_error < 0.15 and agreement >= 0.85, (max_error, agreement)  # the CPU test's bounds


@needs_fp8_gemm
@pytest.mark.parametrize("scheme", list(FP8_GEMM_BOUNDS))
def test_fp8_checkpoint_on_cuda_runs_the_fp8_gemm(scheme, tiny_checkpoint, quantized_checkpoint, hf_reference):
    """No monkeypatching here: on Hopper the loader itself keeps the fp8 weights and picks Fp8Linear."""
    quantized, reference = quantized_checkpoint(scheme, tiny_checkpoint("llama"))
    hf_model, _ = hf_reference(reference)
    llm = LLM(quantized, **ENGINE)
    assert linear_kinds(llm) == {"Fp8Linear"}
    weight = llm.engine.model.model.layers[0].mlp.down_proj.weight
    assert weight.dtype == torch.float8_e4m3fn and weight.is_cuda
    max_error, agreement = teacher_forced_errors(llm, hf_model, sequences())
    bound, min_agreement = FP8_GEMM_BOUNDS[scheme]
    assert max_error < bound and agreement >= min_agreement, (max_error, agreement)


def test_fp8_block_checkpoint_on_cuda_is_dequantized_and_exact(tiny_checkpoint, quantized_checkpoint, hf_reference):
    """Block-scaled fp8 has no _scaled_mm form here: dequantized at load, it is the dequantized model's logits."""
    quantized, reference = quantized_checkpoint("fp8_block", tiny_checkpoint("llama"))
    hf_model, _ = hf_reference(reference)
    llm = LLM(quantized, **ENGINE)
    assert linear_kinds(llm) == {"Linear"}
    max_error, agreement = teacher_forced_errors(llm, hf_model, sequences())
    bound, min_agreement = BOUNDS["fp8_block"]
    assert max_error < bound and agreement >= min_agreement, (max_error, agreement)
