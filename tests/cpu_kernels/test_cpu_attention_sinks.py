"""Layers with attention sinks (gpt-oss) on the native CPU kernel, on every instruction set this CPU runs: each
sink joins its head's softmax denominator. The oracle is the torch reference, itself checked against transformers'
eager gpt-oss attention in tests/kernels/test_attention_sinks.py."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_native
from kernels.cpu_paged_attention import native_applies, paged_attention_cpu
from kernels.paged_attention_ref import paged_attention_ref
from tests.paged_batches import make_batch, route_prompts_to_flash

# (query lengths, context lengths): decodes (the few-rows path), a prompt and a prefix's chunk (the column layout
# past 8 rows per KV head), short verify-like queries, all in one batch too.
BATCHES = [
    pytest.param([1, 1, 1], [20, 9, 70], id="decodes"),
    pytest.param([40], [40], id="prompt"),
    pytest.param([24, 1, 3], [60, 33, 35], id="mixed"),
]


def _tolerance(dtype):
    return {"atol": 3e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
@pytest.mark.parametrize("q_lens, context_lens", BATCHES)
def test_sinks_match_the_reference(isa, threads, q_lens, context_lens, window, dtype):
    torch.manual_seed(0)
    batch = make_batch(q_lens, context_lens, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=dtype)
    sinks = (torch.randn(8) * 2).to(dtype)
    expected = paged_attention_ref(*batch, 0.125, window, sinks)
    got = paged_attention_cpu(*batch, 0.125, window, sinks)
    torch.testing.assert_close(got.float(), expected.float(), **_tolerance(dtype))
    without = paged_attention_cpu(*batch, 0.125, window)
    assert not torch.allclose(without.float(), expected.float(), atol=1e-2)  # the sinks changed the outputs


@pytest.mark.parametrize("sink", [40.0, -40.0, float("-inf")], ids=["dominant", "negligible", "minus-inf"])
def test_a_sink_far_above_or_below_every_score_neither_overflows_nor_vanishes_wrongly(isa, sink):
    """A sink far above every score takes nearly all the weight (outputs near zero, finite); one far below, or
    -inf, leaves plain attention."""
    torch.manual_seed(1)
    batch = make_batch([1, 5], [30, 12], num_q_heads=4, num_kv_heads=4, head_dim=32, page_size=8)
    sinks = torch.full((4,), sink)
    got = paged_attention_cpu(*batch, 32 ** -0.5, None, sinks)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, paged_attention_ref(*batch, 32 ** -0.5, None, sinks), atol=3e-5, rtol=1e-4)
    if sink < 0:
        torch.testing.assert_close(got, paged_attention_cpu(*batch, 32 ** -0.5), atol=1e-6, rtol=1e-6)
    else:
        assert got.abs().max() < 1e-6


def test_sinks_run_native_not_the_reference(monkeypatch):
    batch = make_batch([3, 1], [10, 7], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4)
    if not native_applies(*batch[:3]):
        pytest.skip("a build without the native module: the reference is all there is")
    import kernels.cpu_paged_attention as cpu

    def no_reference(*args, **kwargs):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(cpu, "paged_attention_ref", no_reference)
    paged_attention_cpu(*batch, 32 ** -0.5, None, torch.randn(4))
    with pytest.raises(ValueError, match="one per query head"):
        paged_attention_cpu(*batch, 32 ** -0.5, None, torch.randn(2))


def test_sinks_keep_prompts_off_the_flash_route(monkeypatch):
    """torch's flash attention takes no sinks: an AMX CPU's routed bf16 prompt chunks stay native in a sink layer."""
    if cpu_native.ops is None:
        pytest.skip("kernels._cpu_ops is not built")
    routed = route_prompts_to_flash(monkeypatch, [torch.bfloat16])
    batch = make_batch([12], [12], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4, dtype=torch.bfloat16)
    sinks = torch.randn(4).to(torch.bfloat16)
    got = paged_attention_cpu(*batch, 32 ** -0.5, None, sinks)
    assert routed == []
    torch.testing.assert_close(got.float(), paged_attention_ref(*batch, 32 ** -0.5, None, sinks).float(),
                               atol=2e-2, rtol=2e-2)
    paged_attention_cpu(*batch, 32 ** -0.5)
    assert routed == [(12, 12)]  # without sinks the same chunk is routed
