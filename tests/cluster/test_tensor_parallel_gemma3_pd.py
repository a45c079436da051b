"""Gemma 3 (local layers with an 8-token window among global ones) with two ranks on both ends of a cluster:
1P(TP 2) + 1D(TP 2), both on the overlap pipeline (each step launched before the last one's tokens are read, the
ranks driven from the execution stream's thread), every prompt prefilled remotely, prompts longer than the window.
The global layers' blocks move whole and the local layers' last window only, each KV head packed from the
prefill rank that holds it and landed in the decode rank that reads it; greedy output through the router is
transformers' fp32 own, token for token (logprobs within 1e-4), the bytes are a TP 1 -> TP 1 transfer's windowed
formula, and every KV block comes back."""

from __future__ import annotations

import pytest

from tests.cluster.conftest import (CLUSTER_CONFIG, check_greedy_against_transformers, sent_kv_bytes_after,
                                    wait_for_idle_blocks, windowed_kv_bytes, worker_metric)
from tests.cluster.test_tensor_parallel_cluster import worker_entry
from tests.cluster.test_tensor_parallel_pd import KV_BYTES, received_bytes, start
from tests.gemma_checkpoints import LOCAL_LAYERS, gemma3_checkpoint  # noqa: F401 (a fixture)

PROMPTS = ["Sliding window attention lets each local layer look back only a few tokens, while the global layers "
           "see the whole prompt.", "def main():\n"]


@pytest.fixture(scope="module")
def gemma3_tp2(gemma3_checkpoint, tmp_path_factory):  # noqa: F811
    with start(gemma3_checkpoint("gemma3"), tmp_path_factory, 1, {"prefill-0": 2, "decode-0": 2},
               config={"enable_overlap_scheduler": True}) as cluster:
        yield cluster


def test_windowed_kv_moves_between_two_rank_workers(gemma3_tp2, gemma3_checkpoint, hf_reference):  # noqa: F811
    model, tokenizer = hf_reference(gemma3_checkpoint("gemma3"))
    assert model.config.num_key_value_heads == 2  # one per rank on both ends
    for worker in ("prefill-0", "decode-0"):
        assert len(worker_entry(gemma3_tp2.url, worker)["rank_pids"]) == 1
    ids_of = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    assert len(ids_of[0]) > 2 * model.config.sliding_window
    for ids in ids_of:
        sent_before = worker_metric(gemma3_tp2.url, KV_BYTES, "prefill-0") or 0.0
        received_before = received_bytes(gemma3_tp2.url, ["decode-0"])
        check_greedy_against_transformers(gemma3_tp2, model, tokenizer, [ids], 10, is_remote_prefill=True)
        windowed, _ = windowed_kv_bytes(model.config, LOCAL_LAYERS["gemma3"], len(ids))
        assert sent_kv_bytes_after(gemma3_tp2.url, "prefill-0", sent_before, windowed) == windowed
        assert received_bytes(gemma3_tp2.url, ["decode-0"]) - received_before == windowed
    wait_for_idle_blocks(gemma3_tp2.url, gemma3_tp2.worker_names, CLUSTER_CONFIG["kv_cache"]["num_blocks"],
                         timeout_s=20)
