"""Native paged attention against ``paged_attention_ref``: decodes, prefill over cached prefixes, chunked
prefill, mixed batches, short (verify) queries, GQA ratios 1-8, head dims 32-128, page sizes 1-32,
sliding windows, fp32 and bf16 (decodes in bf16 pairs where the body has them), one and two threads, every
instruction set."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_native
from kernels.cpu_paged_attention import native_applies, paged_attention_cpu
from kernels.paged_attention_ref import paged_attention_ref
from tests.paged_batches import make_batch, route_prompts_to_flash

# (q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, page_size)
CASES = [
    pytest.param([1] * 6, [1, 7, 16, 17, 300, 45], 8, 4, 64, 16, id="decode-gqa2-d64-p16"),
    pytest.param([1] * 40, list(range(3, 403, 10)), 8, 1, 128, 16, id="decode-gqa8-d128-many-seqs"),
    pytest.param([1, 1, 1], [600, 257, 511], 4, 4, 64, 32, id="decode-mha-long-contexts-p32"),
    pytest.param([37, 130], [37, 130], 4, 2, 64, 16, id="prefill-fresh-ragged"),
    pytest.param([64, 3], [200, 40], 16, 4, 128, 8, id="chunked-prefill-over-prefix-gqa4-d128"),
    # chunks of keys every row of a tile sees (no mask: softmax_columns' all-visible path) beside the diagonal's
    pytest.param([32, 100], [300, 420], 8, 4, 64, 16, id="prefill-tiles-over-long-prefixes"),
    pytest.param([9, 2], [9, 35], 4, 2, 32, 1, id="page-size-1-d32"),
    pytest.param([1, 9, 1, 70, 4], [20, 30, 65, 90, 4], 8, 2, 64, 4, id="mixed-decodes-chunks-short-queries"),
    pytest.param([4, 4, 4, 4], [9, 30, 4, 100], 8, 4, 64, 16, id="verify-rows"),
    pytest.param([6, 4], [6, 21], 6, 2, 48, 16, id="gqa3-d48"),
    pytest.param([33], [33], 2, 2, 80, 16, id="d80-narrower-isa"),
]


def check(batch, sliding_window=None, dtype=torch.float32):
    query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables = batch
    scale = query.shape[-1] ** -0.5
    assert native_applies(query, k_cache, v_cache)
    expected = paged_attention_ref(query.float(), k_cache.float(), v_cache.float(), cu_seqlens_q, context_lens,
                                   block_tables, scale, sliding_window)
    actual = paged_attention_cpu(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                                 sliding_window)
    assert actual.shape == query.shape and actual.dtype == dtype
    tolerance = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(actual.float(), expected, **tolerance)


@pytest.mark.parametrize("q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, page_size", CASES)
def test_matches_reference(isa, threads, q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, page_size):
    torch.manual_seed(0)
    check(make_batch(q_lens, context_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     page_size=page_size))


@pytest.mark.parametrize("sliding_window", [1, 5, 64])
def test_sliding_window(isa, sliding_window):
    torch.manual_seed(1)
    check(make_batch([1, 30, 1, 3], [100, 30, 7, 70], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16),
          sliding_window=sliding_window)


def test_bf16(isa, threads):
    torch.manual_seed(2)
    batch = make_batch([1, 50, 1, 4], [300, 80, 9, 12], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                       dtype=torch.bfloat16)
    check(batch, dtype=torch.bfloat16)


@pytest.mark.parametrize("q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, page_size", CASES)
def test_bf16_matches_reference(isa, q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, page_size):
    """Every shape on a bf16 cache: the decodes and short queries of the *_bf16 bodies run in bf16 pairs (head dims
    of a multiple of 32), the others widen to fp32."""
    torch.manual_seed(3)
    check(make_batch(q_lens, context_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     page_size=page_size, dtype=torch.bfloat16), dtype=torch.bfloat16)


PAIRED_BODIES = [("avx512_bf16", "avx512"), ("vec512_bf16", "vec512")]


@pytest.mark.parametrize("pairs, widening", PAIRED_BODIES, ids=[p for p, _ in PAIRED_BODIES])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(8, 4, 64), (32, 4, 64), (16, 2, 128), (4, 4, 32)])
@pytest.mark.parametrize("sliding_window", [None, 40])
def test_bf16_pairs_follow_the_widening_body(pairs, widening, num_q_heads, num_kv_heads, head_dim, sliding_window):
    """Decodes, short queries and prefill tiles in bf16 pairs (AVX512-BF16's vdpbf16ps, or its portable twin)
    against the same body widening to fp32: they differ only by each chunk's probabilities rounded to bf16 before
    P.V (relative 2^-9 each) and the order of fp32 sums, so the outputs stay within two bf16 steps of each other;
    odd key counts (the last key paired with a zero weight) and keys across many chunks included."""
    if pairs not in cpu_native.ops.supported_isas():
        pytest.skip(f"this CPU has no {pairs.removesuffix('_bf16')} with AVX512-BF16")
    torch.manual_seed(4)
    batch = make_batch([1, 1, 37, 3, 130, 2], [1, 17, 37, 300, 601, 45], num_q_heads=num_q_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=16, dtype=torch.bfloat16)
    query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables = batch
    outputs = {}
    before = cpu_native.ops.isa()
    try:
        for body in (pairs, widening):
            cpu_native.ops.set_isa(body)
            outputs[body] = paged_attention_cpu(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                                                head_dim ** -0.5, sliding_window).float()
    finally:
        cpu_native.ops.set_isa(before)
    torch.testing.assert_close(outputs[pairs], outputs[widening], atol=1e-2, rtol=2 ** -7)
    expected = paged_attention_ref(query.float(), k_cache.float(), v_cache.float(), cu_seqlens_q, context_lens,
                                   block_tables, head_dim ** -0.5, sliding_window)
    assert (outputs[pairs] - expected).abs().max() <= 2 * (outputs[widening] - expected).abs().max() + 1e-2


def test_layouts_it_does_not_take_run_the_reference():
    torch.manual_seed(3)
    query, k_cache, v_cache, cu, lens, tables = make_batch([1, 5], [9, 5], num_q_heads=4, num_kv_heads=2,
                                                           head_dim=64, page_size=4, dtype=torch.float16)
    assert not native_applies(query, k_cache, v_cache)  # fp16: the reference's job
    out = paged_attention_cpu(query, k_cache, v_cache, cu, lens, tables, 0.125)
    torch.testing.assert_close(out, paged_attention_ref(query, k_cache, v_cache, cu, lens, tables, 0.125))


@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(72, 1, 8), (2, 1, 640)])
def test_shapes_past_the_native_kernels_limits_run_the_reference(num_q_heads, num_kv_heads, head_dim):
    """A GQA group over 64 or a head dim over 576 (DeepSeek's latent rows): the native kernel refuses them (a worker
    serving such a model failed every request), so the reference runs."""
    torch.manual_seed(4)
    query, k_cache, v_cache, cu, lens, tables = make_batch([1, 5], [9, 5], num_q_heads=num_q_heads,
                                                           num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=4)
    assert not native_applies(query, k_cache, v_cache)
    out = paged_attention_cpu(query, k_cache, v_cache, cu, lens, tables, 0.125)
    torch.testing.assert_close(out, paged_attention_ref(query, k_cache, v_cache, cu, lens, tables, 0.125))


@pytest.fixture
def flash_route(monkeypatch):
    """Every sequence of 4 or more query rows, fp32 and bf16, routed to torch's flash attention; (query rows,
    keys) of each routed sequence, in order."""
    return route_prompts_to_flash(monkeypatch, (torch.float32, torch.bfloat16))


def routed_rows(flash_route) -> list[int]:
    return [rows for rows, _ in flash_route]


@pytest.mark.parametrize("q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, page_size", CASES)
def test_flash_route_matches_reference(isa, flash_route, q_lens, context_lens, num_q_heads, num_kv_heads, head_dim,
                                       page_size):
    """Long sequences through torch's flash attention and the rest of the same batch through the native kernel
    (a sub-batch of their rows) land in the right rows."""
    torch.manual_seed(3)
    check(make_batch(q_lens, context_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     page_size=page_size))
    assert routed_rows(flash_route) == [n for n in q_lens if n >= 4]


@pytest.mark.parametrize("sliding_window", [None, 5, 64])
def test_flash_route_bf16_over_prefixes_and_windows(isa, threads, flash_route, sliding_window):
    torch.manual_seed(4)
    batch = make_batch([1, 50, 1, 4, 70], [300, 80, 9, 12, 70], num_q_heads=8, num_kv_heads=2, head_dim=64,
                       page_size=16, dtype=torch.bfloat16)
    check(batch, sliding_window=sliding_window, dtype=torch.bfloat16)
    assert routed_rows(flash_route) == [50, 4, 70]


def test_nothing_is_routed_below_the_row_count(flash_route):
    torch.manual_seed(5)
    check(make_batch([1, 3, 1], [40, 3, 7], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16))
    assert routed_rows(flash_route) == []


FLASH_ROWS_OF = """
import os, sys
os.environ.update(dict(arg.split("=", 1) for arg in sys.argv[1:]))
from kernels import cpu_paged_attention
print(cpu_paged_attention.FLASH_MIN_QUERY_ROWS, "|", cpu_paged_attention.describe_prompt_route())
"""


@pytest.mark.parametrize("setting, expected", [("32", "32 | bf16 prompt attention torch flash from 32 rows"),
                                               ("off", "None | prompt attention native")])
def test_the_row_count_can_be_set_for_the_machine(setting, expected):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FLASH_ROWS_OF, f"TANDEM_CPU_FLASH_MIN_QUERY_ROWS={setting}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected


def test_a_bad_row_count_is_a_clear_error():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FLASH_ROWS_OF, "TANDEM_CPU_FLASH_MIN_QUERY_ROWS=lots"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "TANDEM_CPU_FLASH_MIN_QUERY_ROWS='lots': a positive row count, or off" in done.stderr
