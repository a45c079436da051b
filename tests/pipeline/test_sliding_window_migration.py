"""Live migration of a Gemma 3 stream (local layers with an 8-token window) at the engine level, moving only what
the transfer plan moves: every block of the global layers, the local layers' blocks inside the window the
target's next queries see; the target's other local-layer blocks hold garbage. The stream goes on exactly as the
uninterrupted one, and the target never offers those blocks as a cached prefix. The transfer service's part
(pieces, checksums, bytes) is tests/kv_transfer; the cluster's is tests/cluster/test_gemma3_cluster.py."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.layout import kv_layout
from kv_transfer.sliding_window import leaves_blocks_incomplete, num_blocks_sent, plan_request, planned_bytes
from pipeline import LLM
from pipeline.protocol import SamplingParams
from pipeline.protocol.cluster import PrefillRequest
from tests.conftest import assert_no_leaks
from tests.gemma_checkpoints import LOCAL_LAYERS, gemma3_checkpoint  # noqa: F401 (a fixture)
from tests.pipeline.test_engine_exactness import make_prompts
from tests.pipeline.test_live_migration import decode_until
from tests.pipeline.test_resume import run

PAGE = 4


@pytest.fixture(scope="module")
def engines(gemma3_checkpoint):
    def make():
        return LLM(model=gemma3_checkpoint("gemma3"), kv_cache={"page_size": PAGE, "num_blocks": 128}).engine
    return make(), make()


def test_the_engine_names_each_layers_window(engines):
    src, _ = engines
    window = src.hf_config.sliding_window
    assert src.kv.layer_windows() == [window if local else None for local in LOCAL_LAYERS["gemma3"]]


def test_a_stream_moved_with_its_windowed_kv_goes_on_exactly(engines):
    src, dst = engines
    free = {e: e.kv_manager.num_free_blocks for e in (src, dst)}
    prompt = make_prompts(300, [26], seed=11)[0]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    whole = run(src, "whole", prompt, params)
    src.add_request("moved", prompt, params)
    sent = decode_until(src, "moved", 6)
    steps, (seq,) = src.pause_decoding()
    sent += [t for out in steps if out.request_id == "moved" for t in out.new_token_ids]

    dst.add_request("moved", prompt, params, remote_prefill=True, resume_token_ids=sent)
    (reserved,) = dst.kv.reserve_remote()
    dst_blocks = dst.kv.block_table("moved")
    ask = PrefillRequest(request_id="moved@dst", prompt_token_ids=list(reserved.token_ids), sampling_params=params,
                         dst_block_ids=dst_blocks, num_cached_tokens=reserved.num_cached_tokens,
                         transfer_endpoint="ipc://unused", decode_worker_id="dst", ttl_s=5.0, source_request_id="moved")
    layout = kv_layout(src.kv.cache_for_transfer(), "m", layer_windows=src.kv.layer_windows())
    assert leaves_blocks_incomplete(layout, ask)
    dst.kv.withhold_from_prefix_cache("moved")  # as the sink does for such a request
    gen = torch.Generator().manual_seed(0)
    dst.kv_cache[:, :, dst_blocks] = 100 * torch.randn(dst.kv_cache[:, :, dst_blocks].shape, generator=gen)
    src_blocks = src.kv.block_table("moved")
    moved_bytes = 0
    for send in plan_request(layout, ask, 0, num_blocks_sent(ask, PAGE)):
        blocks = slice(send.block_start, send.block_stop)
        dst.kv_cache[send.layers, :, dst_blocks[blocks]] = src.kv_cache[send.layers, :, src_blocks[blocks]]
        moved_bytes += send.num_layer_blocks * layout.layer_block_bytes
    assert moved_bytes == planned_bytes(layout, ask) < layout.kv_bytes(num_blocks_sent(ask, PAGE))
    src.abort_request("moved")  # the handoff is done: the source frees its blocks
    dst.kv.activate_migrated("moved")
    rest = []
    while dst.has_unfinished_requests():
        rest += [t for out in dst.step() if out.request_id == "moved" for t in out.new_token_ids]
    assert sent + rest == whole
    assert dst.kv_manager.find_cached_prefix(seq.token_ids + rest) == []  # nothing of it reusable there
    for engine, before in free.items():
        assert_no_leaks(engine.kv_manager, before)
