"""The torch reference's batched path for short queries (a few tokens per sequence, e.g. speculative
verify steps) against its one-sequence-at-a-time path, which is checked against transformers end to end."""

from __future__ import annotations

import pytest
import torch

import importlib
from tests.kernels.test_triton_paged_attention import make_batch

ref = importlib.import_module("kernels.paged_attention_ref")


@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("q_lens, context_lens", [
    ([4, 4, 4], [9, 30, 4]),  # speculative verify rows: K + 1 = 4 each, one with no cached prefix
    ([2, 5, 1, 3, 20], [2, 17, 40, 8, 25]),  # ragged short queries beside a decode and a long chunk
    ([3] * 40, list(range(3, 43))),  # more sequences than one bucket
])
def test_short_queries_batched_equal_one_at_a_time(monkeypatch, q_lens, context_lens, sliding_window):
    torch.manual_seed(0)
    batch = make_batch(q_lens, context_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
    query, k_cache, v_cache, cu_seqlens_q, lens, block_tables = batch
    scale = 16 ** -0.5
    batched = ref.paged_attention_ref(query, k_cache, v_cache, cu_seqlens_q, lens, block_tables, scale, sliding_window)
    monkeypatch.setattr(ref, "SHORT_QUERY_MAX_LEN", 1)  # every multi-token query one at a time
    single = ref.paged_attention_ref(query, k_cache, v_cache, cu_seqlens_q, lens, block_tables, scale, sliding_window)
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-5)
