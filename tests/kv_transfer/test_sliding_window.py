"""Which blocks a transfer sends per layer: a sliding-window layer only those the sink's queries can still see
(checked against the paged attention kernels themselves), full layers everything, and the bytes that makes."""

from __future__ import annotations

import pytest
import torch

from kernels import load_kernels
from kv_transfer.layout import kv_layout
from kv_transfer.sliding_window import (
    LayerSend, first_needed_block, first_query_position, leaves_blocks_incomplete, plan_sends, planned_bytes,
)
from pipeline.protocol import SamplingParams
from pipeline.protocol.cluster import PrefillRequest
from pipeline.protocol.transfer import KVLayout

PAGE = 4


def request(num_prompt_tokens: int, num_cached_tokens: int = 0, n: int = 1, migrated: bool = False) -> PrefillRequest:
    return PrefillRequest(request_id="r", prompt_token_ids=list(range(num_prompt_tokens)),
                          sampling_params=SamplingParams(max_tokens=4, n=n, temperature=0.0 if n == 1 else 1.0),
                          dst_block_ids=list(range(100, 100 + num_prompt_tokens // PAGE + 2)),
                          num_cached_tokens=num_cached_tokens, transfer_endpoint="ipc://d", decode_worker_id="d0",
                          ttl_s=5.0, source_request_id="s" if migrated else None)


def layout(windows: tuple[int, ...]) -> KVLayout:
    return KVLayout(model_hash="m", dtype="float32", page_size=PAGE, num_layers=len(windows), num_kv_heads=2,
                    head_dim=8, layer_windows=windows)


def test_the_first_needed_block_holds_the_first_key_a_query_from_there_on_sees():
    # the kernels' rule: a query at q sees keys q - W + 1 .. q
    for window in (1, 3, 4, 8, 13):
        for first_query in range(0, 60):
            first_key = max(first_query - window + 1, 0)
            assert first_needed_block(window, PAGE, first_query) == first_key // PAGE
    assert first_needed_block(0, PAGE, 1000) == 0  # full attention: everything


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("window,num_tokens,num_queries", [(8, 40, 1), (8, 37, 1), (6, 33, 1), (5, 29, 3),
                                                          (16, 20, 1), (8, 36, 4)])
def test_blocks_before_the_first_needed_one_never_change_what_the_kernel_computes(backend, window, num_tokens,
                                                                                 num_queries):
    """Garbage in every block before ``first_needed_block`` leaves the attention output bit for bit the same,
    and garbage in that block changes it (the rule skips nothing needed and sends no whole block too many)."""
    kernels = load_kernels(backend)
    gen = torch.Generator().manual_seed(window * 100 + num_tokens)
    num_kv_heads, head_dim, num_q_heads = 2, 16, 4
    kv_len = num_tokens + num_queries  # the sink's queries at num_tokens .. num_tokens + num_queries - 1
    num_blocks = -(-kv_len // PAGE)
    k_cache = torch.randn(num_blocks, PAGE, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, PAGE, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(num_queries, num_q_heads, head_dim, generator=gen)
    args = (torch.tensor([0, num_queries], dtype=torch.int32), torch.tensor([kv_len], dtype=torch.int32),
            torch.arange(num_blocks, dtype=torch.int32)[None], head_dim ** -0.5, window)
    before = kernels.paged_attention(query, k_cache, v_cache, *args)
    first = first_needed_block(window, PAGE, num_tokens)
    assert first > 0
    garbage_k, garbage_v = k_cache.clone(), v_cache.clone()
    garbage_k[:first] = 1e4 * torch.randn(first, PAGE, num_kv_heads, head_dim, generator=gen)
    garbage_v[:first] = 1e4 * torch.randn(first, PAGE, num_kv_heads, head_dim, generator=gen)
    assert torch.equal(kernels.paged_attention(query, garbage_k, garbage_v, *args), before)
    garbage_v[first] += 1.0
    assert not torch.equal(kernels.paged_attention(query, garbage_k, garbage_v, *args), before)


def test_plan_sends_full_layers_everything_and_sliding_layers_their_window():
    # Gemma 3's pattern: local, local, global, local, local; window 8, a 40-token prompt: queries from 40 see keys
    # from 33 on (block 8), so blocks 0..7 go for the global layer only
    windows = (8, 8, 0, 8, 8)
    sends = plan_sends(windows, PAGE, 40, 0, 10)
    assert sends == [LayerSend(2, 3, 0, 8), LayerSend(0, 5, 8, 10)]
    # shipped in pieces as chunks complete: the same blocks per layer
    pieces = [send for start, stop in ((0, 5), (5, 9), (9, 10)) for send in plan_sends(windows, PAGE, 40, start, stop)]
    per_layer = {layer: sorted(b for s in pieces for b in range(s.block_start, s.block_stop)
                               if s.layer_start <= layer < s.layer_stop) for layer in range(5)}
    assert per_layer == {0: [8, 9], 1: [8, 9], 2: list(range(10)), 3: [8, 9], 4: [8, 9]}
    # different windows per layer, and a range no layer needs
    assert plan_sends((0, 4, 12), PAGE, 40, 0, 10) == [LayerSend(0, 1, 0, 7), LayerSend(0, 1, 7, 9),
                                                       LayerSend(2, 3, 7, 9), LayerSend(0, 3, 9, 10)]
    assert plan_sends((8, 8), PAGE, 40, 0, 8) == []
    assert plan_sends((0, 0, 0), PAGE, 40, 3, 10) == [LayerSend(0, 3, 3, 10)]  # no windows: as before


def test_planned_bytes_match_the_formula():
    record = layout((8, 8, 0, 8, 8))
    per_block_layer = 2 * PAGE * 2 * 8 * 4  # K and V pages, float32
    assert record.layer_block_bytes == per_block_layer
    # 40 prompt tokens: full layers x 10 blocks + sliding layers x 2 blocks
    assert planned_bytes(record, request(40)) == (1 * 10 + 4 * 2) * per_block_layer
    # prompt of 41: 11 blocks, the window's first key 34 is in block 8 -> 3 blocks per sliding layer
    assert planned_bytes(record, request(41)) == (1 * 11 + 4 * 3) * per_block_layer
    # shorter than the window: everything, every layer
    assert planned_bytes(record, request(6)) == 5 * 2 * per_block_layer
    # the sink holds 9 blocks already: only block 9, every layer
    assert planned_bytes(record, request(40, num_cached_tokens=36)) == 5 * 1 * per_block_layer
    # a migrated stream: its last token's KV is the target's to compute
    assert planned_bytes(record, request(41, migrated=True)) == planned_bytes(record, request(40))
    # no windows in the record: every layer whole
    assert planned_bytes(layout((0,) * 5), request(40)) == 5 * 10 * per_block_layer


def test_several_choices_keep_the_block_a_fork_recomputes_in_the_window():
    # choices fork the full blocks before the last prompt token and compute the rest themselves: from 36 on
    assert first_query_position(request(40), PAGE) == 40
    assert first_query_position(request(40, n=2), PAGE) == 36
    assert first_query_position(request(41, n=2), PAGE) == 40
    assert planned_bytes(layout((8, 0)), request(40, n=2)) > planned_bytes(layout((8, 0)), request(40))


def test_only_a_transfer_that_skips_blocks_leaves_them_incomplete():
    record = layout((8, 0))
    assert leaves_blocks_incomplete(record, request(40))
    assert not leaves_blocks_incomplete(record, request(8))  # the window covers the prompt
    assert not leaves_blocks_incomplete(record, request(40, num_cached_tokens=36))  # the sink's cache covers the rest
    assert not leaves_blocks_incomplete(layout((0, 0)), request(40))


def test_the_compatibility_record_carries_the_windows_and_refuses_a_different_one():
    cache = torch.zeros(3, 2, 4, PAGE, 2, 8)
    record = kv_layout(cache, "m", layer_windows=[8, None, 8])
    assert record.layer_windows == (8, 0, 8) and record.attention_windows == (8, 0, 8)
    assert kv_layout(cache, "m", layer_windows=[None] * 3).layer_windows == ()  # no window: as before
    assert kv_layout(cache, "m").attention_windows == (0, 0, 0)
    (problem,) = record.mismatch(kv_layout(cache, "m", layer_windows=[4, None, 4]))
    assert problem.startswith("layer_windows:")
    with pytest.raises(ValueError, match="layer_windows"):
        kv_layout(cache, "m", layer_windows=[8, None])
