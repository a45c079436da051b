"""DeepSeek-V3 (multi-head latent attention) with two ranks on both ends of a cluster: 1P(TP 2) + 1D(TP 2), every
prompt prefilled remotely. Each rank caches the whole latent row of every token, so the prefill worker packs the
latent pages from one rank and the decode worker lands them in both of its ranks' caches. Greedy output through the
router is transformers' fp32 own, token for token (logprobs within 1e-4); the bytes each end counts are the latent
rows' (a TP 1 -> TP 1 transfer's); afterwards every KV block is back."""

from __future__ import annotations

import pytest

from tests.cluster.conftest import (CLUSTER_CONFIG, check_greedy_against_transformers, sent_kv_bytes_after,
                                    wait_for_idle_blocks, worker_metric)
from tests.cluster.test_tensor_parallel_cluster import worker_entry
from tests.cluster.test_tensor_parallel_pd import KV_BYTES, received_bytes, start
from tests.deepseek_checkpoints import deepseek_checkpoint  # noqa: F401 (a fixture)

PROMPTS = ["Hello there, how are you?", "The quick brown fox jumps over the lazy dog, twice."]


@pytest.fixture(scope="module")
def latent_tp2(deepseek_checkpoint, tmp_path_factory):  # noqa: F811
    with start(deepseek_checkpoint("deepseek_v3"), tmp_path_factory, 1, {"prefill-0": 2, "decode-0": 2}) as cluster:
        yield cluster


def test_latent_kv_moves_between_two_rank_workers(latent_tp2, deepseek_checkpoint, hf_reference):  # noqa: F811
    model, tokenizer = hf_reference(deepseek_checkpoint("deepseek_v3"))
    for worker in ("prefill-0", "decode-0"):
        assert len(worker_entry(latent_tp2.url, worker)["rank_pids"]) == 1
    config, page_size = model.config, CLUSTER_CONFIG["kv_cache"]["page_size"]
    latent_block_bytes = config.num_hidden_layers * page_size * (config.kv_lora_rank + config.qk_rope_head_dim) * 4
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        sent_before = worker_metric(latent_tp2.url, KV_BYTES, "prefill-0") or 0.0
        received_before = received_bytes(latent_tp2.url, ["decode-0"])
        check_greedy_against_transformers(latent_tp2, model, tokenizer, [ids], 10, is_remote_prefill=True)
        want = -(-len(ids) // page_size) * latent_block_bytes  # fp32 latent rows, once whatever the ranks
        assert sent_kv_bytes_after(latent_tp2.url, "prefill-0", sent_before, want) == want
        assert received_bytes(latent_tp2.url, ["decode-0"]) - received_before == want
    wait_for_idle_blocks(latent_tp2.url, latent_tp2.worker_names, CLUSTER_CONFIG["kv_cache"]["num_blocks"],
                         timeout_s=20)
