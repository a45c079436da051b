"""Native RMSNorm (+ residual), rotary embedding, KV store and SiLU * up against their torch references.

The residual add, rotary embedding and KV store round exactly where torch rounds, so they are checked
bit for bit; RMSNorm's mean of squares and SiLU's exp differ from torch's in the last bit only."""

from __future__ import annotations

import pytest
import torch

from kernels.activation_ref import silu_and_mul_ref
from kernels.cpu_elementwise import apply_rotary_cpu, rms_norm_cpu, silu_and_mul_cpu, store_kv_cpu
from kernels.kv_store_ref import store_kv_ref
from kernels.norm_rope_ref import apply_rotary_ref, rms_norm_ref, rope_cos_sin_cache

DTYPES = [torch.float32, torch.bfloat16]


def close(dtype):
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 64), (7, 512), (300, 96), (2048, 256)])
def test_rms_norm(isa, threads, dtype, rows, hidden):
    torch.manual_seed(0)
    x, residual = (torch.randn(rows, hidden).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    alone = rms_norm_cpu(x, weight, 1e-6)
    torch.testing.assert_close(alone, rms_norm_ref(x, weight, 1e-6), **close(dtype))
    out, summed = rms_norm_cpu(x, weight, 1e-6, residual)
    want_out, want_sum = rms_norm_ref(x, weight, 1e-6, residual)
    assert torch.equal(summed, want_sum)  # the residual stream is exact
    torch.testing.assert_close(out, want_out, **close(dtype))
    assert torch.equal(residual, residual.clone())  # inputs are never written


def test_rms_norm_of_strided_rows(isa):
    torch.manual_seed(1)
    wide = torch.randn(10, 3, 64)
    x = wide[:, 1]  # rows 192 apart
    weight = torch.rand(64)
    torch.testing.assert_close(rms_norm_cpu(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(8, 4, 64), (4, 1, 128), (2, 2, 32)])
def test_rotary_is_bit_exact_on_views_of_a_fused_projection(isa, threads, dtype, num_q_heads, num_kv_heads,
                                                             head_dim):
    torch.manual_seed(2)
    tokens = 37
    qkv = torch.randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    query = qkv[:, :q_size].reshape(tokens, num_q_heads, head_dim)  # strided views, as the model passes them
    key = qkv[:, q_size:q_size + kv_size].reshape(tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 4096, (tokens,))
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos_sin = rope_cos_sin_cache(inv_freq, 4096)
    before = qkv.clone()
    q, k = apply_rotary_cpu(query, key, positions, cos_sin)
    want_q, want_k = apply_rotary_ref(query, key, positions, cos_sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(isa, dtype):
    torch.manual_seed(3)
    kv = torch.randn(20, 3, 4, 64).to(dtype)  # [tokens, q|k|v, heads, dim]: key and value are strided views
    slots = torch.randperm(8 * 16)[:20]
    slots[::5] = -1  # skipped
    k_cache, v_cache = torch.randn(8, 16, 4, 64).to(dtype), torch.randn(8, 16, 4, 64).to(dtype)
    caches = [k_cache, v_cache, k_cache.clone(), v_cache.clone()]  # the skipped slots keep what they held
    store_kv_ref(kv[:, 1], kv[:, 2], caches[0], caches[1], slots)
    store_kv_cpu(kv[:, 1], kv[:, 2], caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 688), (48, 1376), (513, 64)])
def test_silu_and_mul(isa, threads, dtype, rows, width):
    torch.manual_seed(4)
    x = (torch.randn(rows, 2 * width) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated exp both ways, and zeros
    torch.testing.assert_close(silu_and_mul_cpu(x), silu_and_mul_ref(x), **close(dtype))
