"""Triton paged attention against ``paged_attention_ref``: prefill over cached prefixes, decode,
mixed batches, GQA, sliding windows, page sizes from 1 to 32, and the split-KV (flash-decoding) path."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention_ref import paged_attention_ref
from tests.paged_batches import make_batch  # noqa: F401  (tests/kernels/test_paged_attention_ref.py imports it here)
from kernels.triton_paged_attention import choose_num_kv_splits, paged_attention_triton, run_paged_attention

def check(batch, *, sliding_window=None, atol=2e-5, rtol=1e-4, **knobs):
    query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables = batch
    scale = query.shape[-1] ** -0.5
    expected = paged_attention_ref(query.float(), k_cache.float(), v_cache.float(), cu_seqlens_q, context_lens,
                                   block_tables, scale, sliding_window)
    if knobs:
        actual = run_paged_attention(*batch, scale, sliding_window, **knobs)
    else:
        actual = paged_attention_triton(*batch, scale, sliding_window)
    assert actual.shape == query.shape and actual.dtype == query.dtype
    torch.testing.assert_close(actual.float(), expected, atol=atol, rtol=rtol)


# (q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, page_size)
PREFILL_CASES = [
    pytest.param([5, 17], [5, 17], 2, 2, 64, 16, id="fresh-ragged-mha-p16"),
    pytest.param([3, 20], [40, 50], 4, 1, 128, 4, id="cached-prefix-gqa4-p4-d128"),
    pytest.param([9, 2], [9, 35], 4, 2, 64, 1, id="cached-prefix-gqa2-p1"),
    pytest.param([1, 9, 1], [20, 30, 65], 4, 2, 64, 32, id="mixed-decode-and-chunk-p32"),
    pytest.param([6, 4], [6, 21], 6, 2, 48, 16, id="gqa3-d48-padded"),
]


@pytest.mark.parametrize("q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, page_size", PREFILL_CASES)
def test_prefill_matches_reference(device, q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, page_size):
    check(make_batch(q_lens, context_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     page_size=page_size, device=device))


DECODE_CASES = [
    pytest.param([1, 33, 70], 2, 2, 64, 1, id="mha-p1"),
    pytest.param([7, 150, 64], 4, 2, 128, 4, id="gqa2-p4-d128-many-pages"),
    pytest.param([16, 17, 95, 3], 4, 1, 64, 16, id="gqa4-p16-page-edges"),
    pytest.param([40, 129], 2, 1, 64, 32, id="gqa2-p32"),
]


@pytest.mark.parametrize("context_lens, num_q_heads, num_kv_heads, head_dim, page_size", DECODE_CASES)
def test_decode_matches_reference(device, context_lens, num_q_heads, num_kv_heads, head_dim, page_size):
    check(make_batch([1] * len(context_lens), context_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, page_size=page_size, device=device))


@pytest.mark.parametrize("num_kv_splits", [2, 3, 8])
def test_split_kv_decode_matches_reference(device, num_kv_splits):
    # 8 splits of a 5-token context leave most splits empty: they must weigh nothing in the reduce
    batch = make_batch([1, 1, 1], [5, 77, 200], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                       device=device)
    check(batch, num_kv_splits=num_kv_splits, block_n=16)


def test_split_kv_prefill_and_window(device):
    # the split path is general: it also holds for multi-token tiles and sliding windows
    batch = make_batch([4, 1, 12], [30, 90, 12], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4,
                       device=device)
    check(batch, num_kv_splits=3, block_n=16)
    check(batch, sliding_window=20, num_kv_splits=4, block_n=16)


@pytest.mark.parametrize("q_lens, context_lens, page_size", [
    pytest.param([1, 1, 1], [10, 45, 130], 16, id="decode"),
    pytest.param([8, 1, 30], [30, 40, 30], 4, id="prefill-and-decode"),
])
def test_sliding_window_matches_reference(device, q_lens, context_lens, page_size):
    check(make_batch(q_lens, context_lens, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=page_size,
                     device=device), sliding_window=16)


def test_small_tiles_cover_many_iterations(device):
    # tiles smaller than the defaults: many query tiles per sequence and many KV steps per tile
    batch = make_batch([33, 2], [50, 70], num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=4, device=device)
    check(batch, block_m=16, block_n=16)
    check(batch, sliding_window=9, block_m=16, block_n=16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_close_to_reference(device, dtype):
    batch = make_batch([5, 1], [21, 40], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=dtype,
                       device=device)
    check(batch, atol=2e-2, rtol=2e-2)


def test_split_heuristic_never_splits_on_cpu():
    cpu = torch.device("cpu")
    assert choose_num_kv_splits(64, 64, 8, 2048, cpu) == 1  # the CPU interpreter never splits by itself
    assert choose_num_kv_splits(100, 4, 8, 1 << 15, cpu) == 1


@pytest.mark.parametrize("q_lens, context_lens", [
    pytest.param([2, 0, 1], [10, 5, 7], id="as-many-tokens-as-seqs"),  # takes the one-token-tile launch
    pytest.param([0, 3, 1], [4, 9, 7], id="multi-token-tiles"),
])
def test_sequences_without_queries_and_int64_metadata(device, q_lens, context_lens):
    query, k_cache, v_cache, cu_seqlens_q, ctx, block_tables = make_batch(
        q_lens, context_lens, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4, device=device)
    check((query, k_cache, v_cache, cu_seqlens_q.long(), ctx.long(), block_tables.long()))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_half_precision_with_split_kv(cuda_device, dtype):
    batch = make_batch([1] * 8, [2048, 1, 700, 1500, 33, 2047, 1024, 900], num_q_heads=32, num_kv_heads=8,
                       head_dim=128, page_size=16, dtype=dtype, device=cuda_device)
    assert choose_num_kv_splits(8, 8, 8, batch[-1].shape[1] * 16, torch.device(cuda_device)) > 1
    check(batch, atol=1e-2, rtol=1e-2)
    check(batch, sliding_window=512, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_gpu_long_prefill_over_prefix(cuda_device):
    batch = make_batch([300, 1, 129], [1300, 2000, 129], num_q_heads=28, num_kv_heads=4, head_dim=128,
                       page_size=16, dtype=torch.bfloat16, device=cuda_device)
    check(batch, atol=1e-2, rtol=1e-2)
