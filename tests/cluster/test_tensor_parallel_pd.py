"""Prefill and decode workers of different tensor-parallel layouts in real clusters, every prompt prefilled remotely:

- 1P(TP 2) + 1D(TP 1), on Qwen3-MoE (two KV heads: each prefill rank sends its own, read from its shared cache;
  every expert split between the prefill ranks, a dense layer among the sparse ones);
- 1P(TP 1) + 2D(TP 2, TP 1), on Llama (two KV heads: each decode rank of decode-0 receives its own).

Greedy output through the router is transformers' fp32 own, token for token, logprobs within 1e-4; the bytes moved
per prompt are exactly a TP 1 -> TP 1 transfer's (the full-head layout travels; each end re-slices for its ranks; a KV head several ranks share is
covered by tests/kv_transfer/test_sharded_cache.py);
and SIGKILL of decode-0's rank 1 mid-stream fails no request: every stream ends with its exact text (the router moves
them), both ranks come back, and every KV block is back. A decode worker drained with SIGTERM hands its streams,
KV and all, to the decode worker of the other rank count (both ways), nothing recomputed."""

from __future__ import annotations

import os
import signal

import pytest

from deploy.cpu_plan import plan_cores
from tests.cluster.conftest import (CLUSTER_CONFIG, check_concurrent_greedy_streams, check_greedy_against_transformers,
                                    migrations, running_cluster, sent_kv_bytes_after, wait_for_idle_blocks,
                                    wait_for_incarnation, wait_for_metric, wait_for_restart, windowed_kv_bytes,
                                    worker_metric)
from tests.cluster.test_live_migration import metric
from tests.cluster.test_tensor_parallel_cluster import streams_across, wait_restarted, worker_entry
from tests.moe_checkpoints import moe_checkpoint  # noqa: F401 (a fixture)
from tests.pipeline.test_tensor_parallel import is_running

KV_BYTES = "tandem_kv_transfer_bytes_total"
PROMPTS = ["Paged attention keeps keys and values in blocks.", "def main():\n", "Once upon a time, by the sea,"]
NUM_NEW_TOKENS = 10
DRAIN_PROMPTS = [[5, 17, 42, 8], [9, 9, 100, 3, 77], [250, 1, 60], [33, 44, 55, 66, 11], [7, 7, 7], [120, 3, 4]]


def start(model_path: str, tmp_path_factory, num_decode: int, sizes: dict[str, int], **kwargs):
    cores = sorted(os.sched_getaffinity(0))
    return running_cluster(model_path, tmp_path_factory.mktemp("tp-pd"),
                           num_prefill=1, num_decode=num_decode, max_restarts=5, tensor_parallel_sizes=sizes,
                           cpu_plan=plan_cores(cores, 1, num_decode, 0, num_ranks=sizes), **kwargs)


@pytest.fixture(scope="module")
def prefill_tp2(moe_checkpoint, tmp_path_factory):
    with start(moe_checkpoint("qwen3_moe"), tmp_path_factory, 1, {"prefill-0": 2}) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def decode_tp2(tiny_checkpoint, tmp_path_factory):
    # slow steps (20 ms each): a 120-token stream runs for seconds, long enough to kill a rank mid-answer
    with start(tiny_checkpoint("llama"), tmp_path_factory, 2, {"decode-0": 2},
               config={"tensor_parallel_timeout_s": 5, "drain_timeout_s": 60.0}, entry_module="tests.cluster.slow_steps",
               env={"TANDEM_TEST_STEP_DELAY_S": "0.02"}) as cluster:
        yield cluster


def received_bytes(url: str, decode_workers: list[str]) -> float:
    return sum(worker_metric(url, KV_BYTES, worker) or 0.0 for worker in decode_workers)


def check_remote_prefill_and_bytes(cluster, model, tokenizer, decode_workers: list[str]) -> None:
    """Each prompt greedy-exact through prefill-0, and the KV bytes both ends count for it are the full-head
    layout's (as TP 1 -> TP 1 moves them: every layer's K and V pages of every prompt block)."""
    layers = [False] * model.config.num_hidden_layers
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        sent_before = worker_metric(cluster.url, KV_BYTES, "prefill-0") or 0.0
        received_before = received_bytes(cluster.url, decode_workers)
        check_greedy_against_transformers(cluster, model, tokenizer, [ids], NUM_NEW_TOKENS, is_remote_prefill=True)
        want, _ = windowed_kv_bytes(model.config, layers, len(ids))
        assert sent_kv_bytes_after(cluster.url, "prefill-0", sent_before, want) == want
        assert received_bytes(cluster.url, decode_workers) - received_before == want  # counted by now too


def test_a_two_rank_prefill_worker_feeds_a_one_rank_decode_worker(prefill_tp2, moe_checkpoint, hf_reference):
    model, tokenizer = hf_reference(moe_checkpoint("qwen3_moe"))
    assert model.config.num_key_value_heads == 2  # one per prefill rank
    assert len(worker_entry(prefill_tp2.url, "prefill-0")["rank_pids"]) == 1
    check_remote_prefill_and_bytes(prefill_tp2, model, tokenizer, ["decode-0"])


def test_a_one_rank_prefill_worker_feeds_a_two_rank_decode_worker(decode_tp2, tiny_checkpoint, hf_reference,
                                                                  reference_text):
    model, tokenizer = hf_reference(tiny_checkpoint("llama"))
    assert model.config.num_key_value_heads == 2  # one per decode rank
    assert len(worker_entry(decode_tp2.url, "decode-0")["rank_pids"]) == 1
    check_remote_prefill_and_bytes(decode_tp2, model, tokenizer, ["decode-0", "decode-1"])
    before = worker_metric(decode_tp2.url, KV_BYTES, "decode-0") or 0.0
    check_concurrent_greedy_streams(decode_tp2.url, reference_text, num_requests=10, seed=5)  # both decode workers
    assert wait_for_metric(decode_tp2.url, KV_BYTES, "decode-0", above=before)


def test_a_killed_decode_rank_fails_no_stream(decode_tp2):
    before = worker_entry(decode_tp2.url, "decode-0")
    assert all(is_running(pid) for pid in [before["pid"], *before["rank_pids"]])
    # decode-0's rank 1, found through the router
    streams_across(decode_tp2, "decode-0", lambda: os.kill(before["rank_pids"][0], signal.SIGKILL))
    assert migrations(decode_tp2.url) >= 1
    wait_restarted(decode_tp2, before, "decode-0")  # both ranks back, nothing of the old incarnation left
    wait_for_idle_blocks(decode_tp2.url, decode_tp2.worker_names, CLUSTER_CONFIG["kv_cache"]["num_blocks"],
                         timeout_s=20)


@pytest.mark.parametrize("victim, heir", [("decode-0", "decode-1"), ("decode-1", "decode-0")])
def test_a_draining_decode_worker_moves_its_streams_with_their_kv_to_another_layout(decode_tp2, victim, heir):
    """SIGTERM: the victim's streams move, KV and all, to the decode worker of the other rank count (TP 2 -> TP 1,
    then TP 1 -> TP 2), with the uninterrupted text and no token recomputed."""
    for worker in ("decode-0", "decode-1"):  # whoever a test before restarted is back
        wait_for_incarnation(decode_tp2.url, worker, decode_tp2.pids[worker], timeout_s=60)
    handed_off = metric(decode_tp2.url, "tandem_migrations_total", '{cause="drain"}')
    recomputed = metric(decode_tp2.url, "tandem_migration_recomputed_tokens_total")
    moved = metric(decode_tp2.url, "tandem_migration_kv_bytes_total")
    old_pid = decode_tp2.pids[victim]
    streams_across(decode_tp2, victim, lambda: decode_tp2.kill(victim, signal.SIGTERM), prompts=DRAIN_PROMPTS)
    assert metric(decode_tp2.url, "tandem_migrations_total", '{cause="drain"}') > handed_off
    assert metric(decode_tp2.url, "tandem_migration_recomputed_tokens_total") == recomputed  # the KV moved
    assert metric(decode_tp2.url, "tandem_migration_kv_bytes_total") > moved
    wait_for_restart(decode_tp2, victim, old_pid, timeout_s=60)
    wait_for_idle_blocks(decode_tp2.url, decode_tp2.worker_names, CLUSTER_CONFIG["kv_cache"]["num_blocks"],
                         timeout_s=30)
