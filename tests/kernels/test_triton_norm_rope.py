"""Triton RMSNorm (+ residual) and rotary embedding against ``norm_rope_ref``."""

from __future__ import annotations

import pytest
import torch

from kernels.norm_rope_ref import apply_rotary_ref, rms_norm_ref, rope_cos_sin_cache
from kernels.triton_norm_rope import apply_rotary_triton, rms_norm_triton

from tests.kernels.conftest import INTERPRETED

# The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest, so bf16 is one ulp off there.
HALF_TOLERANCE = {
    torch.float16: dict(atol=0, rtol=0),
    torch.bfloat16: dict(atol=3e-2, rtol=1.6e-2) if INTERPRETED else dict(atol=0, rtol=0),
}


def assert_matches(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(actual, expected, **HALF_TOLERANCE[dtype])


@pytest.mark.parametrize("hidden", [64, 96, 4096])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_reference(device, hidden, with_residual):
    x = torch.randn(5, hidden, device=device) * 3
    weight = torch.randn(hidden, device=device)
    residual = torch.randn(5, hidden, device=device) if with_residual else None
    expected = rms_norm_ref(x, weight, 1e-6, residual)
    actual = rms_norm_triton(x, weight, 1e-6, residual)
    if with_residual:
        assert_matches(actual[0], expected[0], torch.float32)
        assert torch.equal(actual[1], expected[1])
    else:
        assert_matches(actual, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", ["same", "fp32"])
def test_rms_norm_half_precision(device, dtype, weight_dtype):
    x = torch.randn(4, 128, device=device).to(dtype)
    residual = torch.randn(4, 128, device=device).to(dtype)
    weight = torch.randn(128, device=device).to(dtype if weight_dtype == "same" else torch.float32)
    assert_matches(rms_norm_triton(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), dtype)
    (out, summed), (want_out, want_summed) = (f(x, weight, 1e-5, residual) for f in (rms_norm_triton, rms_norm_ref))
    assert_matches(out, want_out, dtype)
    assert_matches(summed, want_summed, dtype)


def test_rms_norm_leaves_its_inputs_alone(device):
    x, residual = torch.randn(3, 64, device=device), torch.randn(3, 64, device=device)
    x_before, residual_before = x.clone(), residual.clone()
    rms_norm_triton(x, torch.ones(64, device=device), 1e-6, residual)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def make_rotary_inputs(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device):
    # q and k are views into one fused QKV projection, as the attention layer slices them
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, device=device).to(dtype)
    query = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    key = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads,
                                                                                         head_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    cos_sin_cache = rope_cos_sin_cache(inv_freq, 512).to(device)
    positions = torch.randint(0, 512, (num_tokens,), device=device)
    return query, key, positions, cos_sin_cache


@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(4, 4, 64), (8, 2, 128), (4, 1, 48), (3, 1, 64)])
def test_rotary_matches_reference(device, num_q_heads, num_kv_heads, head_dim):
    inputs = make_rotary_inputs(7, num_q_heads, num_kv_heads, head_dim, torch.float32, device)
    for actual, expected in zip(apply_rotary_triton(*inputs), apply_rotary_ref(*inputs)):
        assert_matches(actual, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotary_half_precision(device, dtype):
    inputs = make_rotary_inputs(5, 4, 2, 64, dtype, device)
    for actual, expected in zip(apply_rotary_triton(*inputs), apply_rotary_ref(*inputs)):
        assert_matches(actual, expected, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_half_precision_is_bit_exact(cuda_device, dtype):
    x, residual = (torch.randn(64, 4096, device=cuda_device).to(dtype) for _ in range(2))
    weight = torch.randn(4096, device=cuda_device).to(dtype)
    actual, expected = rms_norm_triton(x, weight, 1e-6, residual), rms_norm_ref(x, weight, 1e-6, residual)
    torch.testing.assert_close(actual[1], expected[1], atol=0, rtol=0)
    torch.testing.assert_close(actual[0], expected[0], atol=1e-2, rtol=1e-2)  # rsqrt may differ by an ulp
    inputs = make_rotary_inputs(64, 32, 8, 128, dtype, cuda_device)
    for got, want in zip(apply_rotary_triton(*inputs), apply_rotary_ref(*inputs)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
