"""Attention sinks (gpt-oss): the torch reference against transformers' own eager gpt-oss attention on
each sequence's K/V gathered dense, and the triton kernel against the reference (under the interpreter
on CPU): prefill over cached prefixes, decode, short verify-like queries, GQA, sliding windows, split-KV."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from kernels.paged_attention_ref import paged_attention_ref
from kernels.triton_paged_attention import run_paged_attention
from tests.paged_batches import make_batch

HEAD_DIM = 16


def transformers_attention(batch, scale, sliding_window, sinks):
    """Each sequence through transformers' ``eager_attention_forward`` with its sinks, over dense K/V."""
    query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables = batch
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    module = SimpleNamespace(num_key_value_groups=query.shape[1] // num_kv_heads, sinks=sinks, training=False)
    outs = []
    for i, kv_len in enumerate(context_lens.tolist()):
        q = query[cu_seqlens_q[i]:cu_seqlens_q[i + 1]]  # [q_len, num_q_heads, head_dim]
        if q.shape[0] == 0:
            continue
        blocks = block_tables[i, : -(-kv_len // page_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:kv_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:kv_len]
        q_pos = torch.arange(kv_len - q.shape[0], kv_len)[:, None]
        k_pos = torch.arange(kv_len)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        mask = torch.where(visible, 0.0, torch.finfo(q.dtype).min)[None, None]  # additive, as transformers masks
        out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], mask, scaling=scale)
        outs.append(out[0])  # [q_len, num_q_heads, head_dim]
    return torch.cat(outs)


# (q_lens, context_lens, num_q_heads, num_kv_heads, page_size)
CASES = [
    pytest.param([7, 12], [7, 12], 4, 2, 4, id="fresh-prompts-gqa2"),
    pytest.param([5, 1, 1], [30, 9, 41], 4, 1, 4, id="chunk-over-prefix-and-decodes-gqa4"),
    pytest.param([1, 1, 1, 1], [3, 17, 16, 50], 6, 2, 16, id="decodes-gqa3"),
    pytest.param([4, 4, 3, 20], [9, 30, 3, 25], 4, 2, 4, id="short-queries-and-a-chunk"),
]


@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("q_lens, context_lens, num_q_heads, num_kv_heads, page_size", CASES)
def test_reference_matches_transformers(q_lens, context_lens, num_q_heads, num_kv_heads, page_size, sliding_window):
    batch = make_batch(q_lens, context_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM,
                       page_size=page_size)
    sinks = torch.randn(num_q_heads) * 2
    scale = HEAD_DIM ** -0.5
    expected = transformers_attention(batch, scale, sliding_window, sinks)
    actual = paged_attention_ref(*batch, scale, sliding_window, sinks)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
    # the sinks change the answer (the test could not pass with them ignored) ...
    assert not torch.allclose(paged_attention_ref(*batch, scale, sliding_window), expected, atol=1e-3)
    # ... and sinks at -inf's edge are no sinks at all: the eager path equals scaled_dot_product_attention's
    no_sinks = paged_attention_ref(*batch, scale, sliding_window, torch.full((num_q_heads,), -1e30))
    torch.testing.assert_close(no_sinks, paged_attention_ref(*batch, scale, sliding_window), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("q_lens, context_lens, num_q_heads, num_kv_heads, page_size", CASES)
def test_triton_matches_reference(device, q_lens, context_lens, num_q_heads, num_kv_heads, page_size, sliding_window):
    batch = make_batch(q_lens, context_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM,
                       page_size=page_size, device=device)
    sinks = (torch.randn(num_q_heads) * 2).to(device)
    scale = HEAD_DIM ** -0.5
    expected = paged_attention_ref(*batch, scale, sliding_window, sinks)
    actual = run_paged_attention(*batch, scale, sliding_window, sinks)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("num_kv_splits", [2, 5])
def test_triton_split_kv_counts_the_sink_once(device, num_kv_splits):
    # 5 splits of a 5-token context leave splits empty; every split but the first starts without the sink
    batch = make_batch([1, 1, 1], [5, 40, 77], num_q_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, page_size=4,
                       device=device)
    sinks = (torch.randn(4) * 2).to(device)
    scale = HEAD_DIM ** -0.5
    expected = paged_attention_ref(*batch, scale, None, sinks)
    actual = run_paged_attention(*batch, scale, None, sinks, num_kv_splits=num_kv_splits, block_n=16)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)
