"""Tensor-parallel colocated workers in a real cluster: colocated-0 runs 2 ranks, colocated-1 one. Streams
through the router are transformers' fp32 greedy text, each rank runs on its own cores, and a rank SIGKILLed
mid-stream takes its worker down whole: no request fails, every stream ends with exactly its text (the router
migrates them), the worker comes back with both ranks, no old rank is left, and every KV block is back."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from deploy.cpu_plan import plan_cores
from pipeline.cpu_placement import rank_cores
from tests.cluster.conftest import (CLUSTER_CONFIG, PROMPT_TOKENS_COMPUTED, check_concurrent_greedy_streams, migrations,
                                    openai_client, routing_summary, running_cluster, wait_for_idle_blocks,
                                    wait_for_incarnation, wait_for_metric)
from tests.pipeline.test_tensor_parallel import is_running, wait_gone

TP_WORKER = "colocated-0"
SIZES = {TP_WORKER: 2}
STREAM_PROMPTS = [[5, 17, 42, 8], [9, 9, 100, 3, 77], [250, 1, 60], [33, 44, 55, 66, 11]]
STREAM_TOKENS = 120


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, tmp_path_factory):
    cores = sorted(os.sched_getaffinity(0))
    # slow steps (20 ms each): a 120-token stream runs for seconds, long enough to kill a rank mid-answer
    with running_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp("tensor-parallel"), num_prefill=0,
                         num_decode=0, num_colocated=2, max_restarts=5, tensor_parallel_sizes=SIZES,
                         cpu_plan=plan_cores(cores, 0, 0, 2, num_ranks=SIZES), config={"tensor_parallel_timeout_s": 5},
                         entry_module="tests.cluster.slow_steps", env={"TANDEM_TEST_STEP_DELAY_S": "0.02"}) as c:
        yield c


def worker_entry(url: str, worker_id: str) -> dict:
    """``worker_id``'s entry in the router's /ready: its pid (rank 0) and ``rank_pids`` (ranks 1..N-1)."""
    return {w["worker_id"]: w for w in httpx.get(f"{url}/ready", timeout=5).json()["workers"]}[worker_id]


def allowed_cores(pid: int) -> list[int]:
    return sorted(os.sched_getaffinity(pid))


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def test_streams_are_transformers_greedy_text_and_the_tp_worker_serves(cluster, reference_text):
    check_concurrent_greedy_streams(cluster.url, reference_text, num_requests=10, seed=3)
    assert wait_for_metric(cluster.url, PROMPT_TOKENS_COMPUTED, TP_WORKER, above=0)  # the 2-rank worker took some
    entry = worker_entry(cluster.url, TP_WORKER)
    [rank1] = entry["rank_pids"]
    assert parent_pid(rank1) == entry["pid"]  # forked by rank 0 as it started (rank_start.prefork_ranks), warm
    assert worker_entry(cluster.url, "colocated-1")["rank_pids"] == []


def test_each_rank_runs_on_its_own_cores(cluster):
    entry = worker_entry(cluster.url, TP_WORKER)
    [rank1] = entry["rank_pids"]
    worker_cores = cluster.cpu_plan[TP_WORKER]
    assert [allowed_cores(entry["pid"]), allowed_cores(rank1)] == rank_cores(worker_cores, 2)
    if len(worker_cores) >= 2:  # on one core the ranks can only share it
        assert not set(allowed_cores(entry["pid"])) & set(allowed_cores(rank1))


def streams_across(cluster, worker: str, act, prompts=STREAM_PROMPTS, num_tokens: int = STREAM_TOKENS) -> None:
    """Greedy streams of ``prompts`` at once; once one has 10 tokens and ``worker`` runs some of them, ``act()``;
    then every stream must complete with transformers' text (the uninterrupted one: 0 failed, nothing repeated
    or missing). Not once every stream has 10 tokens: on a loaded machine the last to start may come after the
    first ones ended (120 tokens at 20 ms a step), and ``worker`` would run none by then."""
    want = [reference_greedy_text(cluster.model_path, p, num_tokens) for p in prompts]
    client = openai_client(cluster)
    name = client.models.list().data[0].id
    results: dict[int, tuple] = {}
    started = threading.Semaphore(0)

    def consume(i: int) -> None:
        text, chunks = "", 0
        try:
            for chunk in client.completions.create(model=name, prompt=prompts[i], max_tokens=num_tokens,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):
                if chunk.choices:
                    text += chunk.choices[0].text
                    chunks += 1
                    if chunks == 10:
                        started.release()
            results[i] = ("completed", text)
        except openai.APIError as exc:
            results[i] = ("error", repr(exc))

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    assert started.acquire(timeout=60), f"no stream started: {results}"
    assert wait_for_metric(cluster.url, "tandem_worker_running_requests", worker, above=0, timeout_s=10), (
        f"{worker} runs none of the streams: {routing_summary(cluster.url)}")
    act()
    for thread in threads:
        thread.join(timeout=120)
    assert results == {i: ("completed", text) for i, text in enumerate(want)}


def reference_greedy_text(model_path: str, prompt_ids: list[int], num_tokens: int) -> str:
    """transformers' fp32 greedy continuation of ``prompt_ids`` (EOS ignored) as text, the model cached."""
    from tests.conftest import hf_greedy

    model, tokenizer = _reference_model(model_path)
    return tokenizer.decode(hf_greedy(model, prompt_ids, num_tokens), skip_special_tokens=True)


@functools.lru_cache(maxsize=4)
def _reference_model(model_path: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(model_path))


def test_a_killed_rank_takes_its_worker_down_and_no_stream_fails(cluster):
    before = worker_entry(cluster.url, TP_WORKER)
    assert all(is_running(pid) for pid in [before["pid"], *before["rank_pids"]])
    # rank 1 of 2, found through the router, not by name
    streams_across(cluster, TP_WORKER, lambda: os.kill(before["rank_pids"][0], signal.SIGKILL))
    assert migrations(cluster.url) >= 1
    wait_restarted(cluster, before)  # rank 0 went with its rank: nothing orphaned, both back
    assert "exited with code 1" in Path(cluster.log_dir, "launcher.log").read_text()  # it exited itself, whole
    # mid-step or between steps, the worker says which rank died and how (not only gloo's connection reset)
    rank1 = before["rank_pids"][0]
    assert f"tensor-parallel rank 1 (pid {rank1}) exited with code -9" in cluster.log_tail(TP_WORKER, 10_000)
    wait_for_idle_blocks(cluster.url, cluster.worker_names, CLUSTER_CONFIG["kv_cache"]["num_blocks"], timeout_s=20)


def wait_restarted(cluster, old: dict, worker: str = TP_WORKER) -> dict:
    """Once ``old`` (a /ready entry of the 2-rank ``worker``) is replaced: no process of it is left, and the new
    incarnation is registered with a live rank 1. Returns the new entry."""
    assert wait_gone([old["pid"], *old["rank_pids"]], timeout_s=60) == []
    deadline = time.monotonic() + 60
    while cluster.pids.get(worker) in (None, old["pid"]):
        assert time.monotonic() < deadline, f"{worker} was not restarted"
        time.sleep(0.1)
    wait_for_incarnation(cluster.url, worker, cluster.pids[worker], timeout_s=60)
    new = worker_entry(cluster.url, worker)
    assert len(new["rank_pids"]) == 1 and all(is_running(pid) for pid in new["rank_pids"])
    return new


def test_a_rank_that_dies_while_its_worker_idles_takes_it_down(cluster):
    """No request runs, so no collective fails: rank 0's loop notices the exit by itself, and tells the router at
    once that nothing new may come (draining) instead of leaving it to send there until the heartbeats stop."""
    before = worker_entry(cluster.url, TP_WORKER)
    os.kill(before["rank_pids"][0], signal.SIGKILL)
    # Which the router learns first, not how fast: the heartbeats' silence would mark it dead (not alive) 3 s after
    # its last message, so seeing it draining while still alive means it was told (a timing bound flaked under load).
    deadline = time.monotonic() + 15
    while not (entry := worker_entry(cluster.url, TP_WORKER))["draining"]:
        assert entry["alive"] and entry["pid"] == before["pid"], \
            "the router was not told the worker is going: it found out from the heartbeats' silence"
        assert time.monotonic() < deadline, "the router was not told the worker is going"
        time.sleep(0.02)
    wait_restarted(cluster, before)


def test_a_hung_rank_is_detected_by_the_collective_timeout(cluster, reference_text):
    """Rank 1 frozen (SIGSTOP): rank 0's next collective gives up after tensor_parallel_timeout_s (5 s here),
    its requests are retried elsewhere with their exact text, and the worker is replaced, the frozen rank killed."""
    log = Path(cluster.log_path(TP_WORKER))
    num_timeouts = log.read_text().count("collective failed on rank 0")
    before = worker_entry(cluster.url, TP_WORKER)
    os.kill(before["rank_pids"][0], signal.SIGSTOP)
    try:
        check_concurrent_greedy_streams(cluster.url, reference_text, num_requests=6, seed=7)  # some land on it
        wait_restarted(cluster, before)
    finally:
        if is_running(before["rank_pids"][0]):
            os.kill(before["rank_pids"][0], signal.SIGKILL)
    assert log.read_text().count("collective failed on rank 0") > num_timeouts
    wait_for_idle_blocks(cluster.url, cluster.worker_names, CLUSTER_CONFIG["kv_cache"]["num_blocks"], timeout_s=20)
