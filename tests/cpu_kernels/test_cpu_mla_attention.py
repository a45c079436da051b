"""Multi-head latent attention (DeepSeek's MLA) on the native CPU kernel, on every instruction set this CPU runs,
against the torch reference (itself the oracle of the triton kernel and, through the model tests, checked against
transformers' DeepSeek-V3)."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_native
from kernels.cpu_mla_attention import mla_attention_cpu
from kernels.mla_attention_ref import mla_attention_ref
from tests.paged_batches import make_batch

BATCHES = [
    pytest.param([1, 1, 1], [20, 9, 70], id="decodes"),
    pytest.param([40], [40], id="prompt"),
    pytest.param([24, 1, 3], [60, 33, 35], id="mixed"),
]


def _latent_batch(q_lens, context_lens, num_heads, kv_lora_rank, rope_dim, dtype):
    query, latent_cache, _, cu_seqlens_q, context_lens, block_tables = make_batch(
        q_lens, context_lens, num_q_heads=num_heads, num_kv_heads=1, head_dim=kv_lora_rank + rope_dim, page_size=16,
        dtype=dtype)
    return query, latent_cache, cu_seqlens_q, context_lens, block_tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_heads", [16, 128], ids=["16heads", "128heads"])
@pytest.mark.parametrize("q_lens, context_lens", BATCHES)
def test_matches_the_reference(isa, threads, q_lens, context_lens, num_heads, dtype):
    """DeepSeek's rows (512 latent + 64 rotary); 128 heads (DeepSeek-V3's) go to the kernel in two groups."""
    torch.manual_seed(0)
    batch = _latent_batch(q_lens, context_lens, num_heads, 512, 64, dtype)
    got = mla_attention_cpu(*batch, 0.07, 512)
    expected = mla_attention_ref(*batch, 0.07, 512)
    assert got.shape == expected.shape == (sum(q_lens), num_heads, 512)
    tolerance = {"atol": 3e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), expected.float(), **tolerance)


def test_a_small_latent_row_matches_too(isa):
    """The tests' tiny DeepSeek configs: a 32 + 16 row, 4 heads."""
    torch.manual_seed(1)
    batch = _latent_batch([5, 1], [12, 30], 4, 32, 16, torch.float32)
    torch.testing.assert_close(mla_attention_cpu(*batch, 0.2, 32), mla_attention_ref(*batch, 0.2, 32),
                               atol=3e-5, rtol=1e-4)


def test_native_runs_and_wider_rows_fall_back(monkeypatch):
    if cpu_native.ops is None:
        pytest.skip("kernels._cpu_ops is not built")
    import kernels.cpu_mla_attention as mla

    calls = []
    real = mla.mla_attention_ref
    monkeypatch.setattr(mla, "mla_attention_ref", lambda *args: calls.append(args) or real(*args))
    mla_attention_cpu(*_latent_batch([3, 1], [10, 7], 16, 512, 64, torch.bfloat16), 0.07, 512)
    assert calls == []
    wide = _latent_batch([3], [10], 4, 576, 64, torch.float32)  # 640 values a row: past the kernel's 576
    torch.testing.assert_close(mla_attention_cpu(*wide, 0.07, 576), real(*wide, 0.07, 576))
    assert len(calls) == 1


@pytest.mark.parametrize("num_rows", [1, 7, 40])
def test_absorbed_products_are_the_per_head_products(panels, num_rows, monkeypatch):
    """Each head's query times its key rows and its weighted latent times its value rows, on the grouped GEMM in bf16:
    fp32 sums rounded once, so within one bf16 rounding of the float64 products (torch.bmm's bf16 rounds likewise).
    Without an AMX CPU's row cap (the next test's), as on a CPU without AMX."""
    from kernels import cpu_moe
    from kernels.cpu_mla_attention import AbsorbedProducts

    monkeypatch.setattr(cpu_moe, "MAX_ROWS_PER_EXPERT", None)

    torch.manual_seed(2)
    heads, nope, v, rank = 16, 128, 128, 512
    w_uk = (torch.randn(heads, nope, rank) * 0.05).to(torch.bfloat16)
    w_uv = (torch.randn(heads, v, rank) * 0.05).to(torch.bfloat16)
    products = AbsorbedProducts(w_uk, w_uv)
    q_nope = torch.randn(num_rows, heads, nope).to(torch.bfloat16)
    latent = torch.randn(num_rows, heads, rank).to(torch.bfloat16)
    want_q = torch.einsum("rhn,hnk->rhk", q_nope.double(), w_uk.double())
    want_out = torch.einsum("rhk,hvk->rhv", latent.double(), w_uv.double())
    for got, want in ((products.queries(q_nope), want_q), (products.outputs(latent), want_out)):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=2 ** -8)
    assert products.queries(q_nope.float()) is None  # another dtype: torch.bmm's job


def test_absorbed_products_leave_large_batches_to_onednn_on_amx(panels, monkeypatch):
    """Where an AMX CPU caps the grouped GEMM's rows (oneDNN's AMX kernels win above), larger batches return None."""
    from kernels import cpu_moe
    from kernels.cpu_mla_attention import AbsorbedProducts

    products = AbsorbedProducts(torch.randn(2, 8, 32).to(torch.bfloat16), torch.randn(2, 8, 32).to(torch.bfloat16))
    monkeypatch.setattr(cpu_moe, "MAX_ROWS_PER_EXPERT", 16)
    assert products.queries(torch.randn(16, 2, 8).to(torch.bfloat16)) is not None
    assert products.queries(torch.randn(17, 2, 8).to(torch.bfloat16)) is None
