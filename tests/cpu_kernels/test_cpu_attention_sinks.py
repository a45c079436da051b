"""Layers with attention sinks (gpt-oss) on the CPU set: the native kernel does not take sinks, so they
run the torch reference (checked against transformers in tests/kernels/test_attention_sinks.py)."""

from __future__ import annotations

import torch

from kernels.cpu_paged_attention import native_applies, paged_attention_cpu
from kernels.paged_attention_ref import paged_attention_ref
from tests.paged_batches import make_batch


def test_sinks_run_the_reference():
    torch.manual_seed(0)
    batch = make_batch([6, 1, 1], [20, 9, 33], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4)
    sinks = torch.randn(4) * 2
    scale = 32 ** -0.5
    for window in (None, 5):
        expected = paged_attention_ref(*batch, scale, window, sinks)
        assert torch.equal(paged_attention_cpu(*batch, scale, window, sinks), expected)
        assert not torch.allclose(paged_attention_cpu(*batch, scale, window), expected, atol=1e-3)


def test_without_sinks_the_native_kernel_still_runs(monkeypatch):
    batch = make_batch([3, 1], [10, 7], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4)
    if not native_applies(*batch[:3]):
        return  # a build without the native module: the reference is all there is
    import kernels.cpu_paged_attention as cpu

    def no_reference(*args, **kwargs):
        raise AssertionError("the reference ran without sinks")

    monkeypatch.setattr(cpu, "paged_attention_ref", no_reference)
    paged_attention_cpu(*batch, 32 ** -0.5, None, None)
