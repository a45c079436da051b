"""Busy is not dead, frozen is: liveness on real processes with the router's deadline at 1 s.

A worker inside one 6-second engine step keeps heartbeating (from its router link's own thread) and
reports how long the step has run; it is never declared dead (nor killed as frozen by a 3 s launcher watchdog)
and its request completes. A worker
frozen with SIGSTOP mid-stream falls silent and is declared dead within the deadline; its streams
move on to the other worker and end with transformers' exact text; after SIGCONT it is admitted again. A 1P1D cluster
whose prefill worker is gone (and not restarted) serves by prefilling on the decode worker.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest

from tests.cluster.conftest import migrations, start_cluster, wait_for_idle_blocks, worker_metric

NUM_BLOCKS = 1024
STREAM_TOKENS = 200  # 4 s at 20 ms a step: every stream is under way when the worker freezes
FAST_LIVENESS = {
    "kv_cache": {"page_size": 4, "num_blocks": NUM_BLOCKS},
    "max_batch_input_tokens": 512,
    "transfer": {"heartbeat_interval_s": 0.2},
    "router": {"dead_after_s": 1.0, "max_local_prefill_length": 0},
}


def client_for(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0, timeout=60)


def workers_alive(url: str) -> dict[str, bool]:
    return {w["worker_id"]: w["alive"] for w in httpx.get(f"{url}/ready", timeout=5).json()["workers"]}


@pytest.mark.solo  # a 1 s liveness deadline: heartbeats on a machine shared with other tests' clusters would miss it
def test_a_worker_inside_a_six_second_step_is_not_declared_dead(tiny_checkpoint, tmp_path, reference_text,
                                                                monkeypatch):
    monkeypatch.setenv("TANDEM_TEST_SLOW_STEP_S", "6")  # 6x dead_after_s, 2x the watchdog's
    monkeypatch.setenv("TANDEM_TEST_SLOW_MIN_CHUNK", "200")
    monkeypatch.setenv("TANDEM_TEST_SLOW_ONCE", "1")
    cluster = start_cluster(tiny_checkpoint("llama"), tmp_path, num_prefill=0, num_decode=0, num_colocated=1,
                            config=FAST_LIVENESS, entry_module="tests.cluster.slow_steps",
                            watchdog_timeout_s=3, max_restarts=1)  # nor is it taken for frozen by the launcher
    try:
        pid = cluster.pids["colocated-0"]
        client = client_for(cluster)
        name = client.models.list().data[0].id
        prompt = [10 + (i * 7) % 280 for i in range(300)]
        outcome: dict = {}
        thread = threading.Thread(target=lambda: outcome.update(
            out=client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)))
        thread.start()
        busy_seen = 0.0
        while thread.is_alive():
            assert workers_alive(cluster.url) == {"colocated-0": True}
            busy_seen = max(busy_seen, (worker_metric(cluster.url, "tandem_worker_busy_in_step_seconds", "colocated-0") or 0.0))
            time.sleep(0.25)
        thread.join()
        assert busy_seen > 3.5, "the heartbeat should report the long step while it runs"
        assert outcome["out"].choices[0].text == reference_text(prompt, 8)[1]
        deadline = time.monotonic() + 5  # the heartbeat after the step carries its length
        while (worker_metric(cluster.url, "tandem_worker_max_step_seconds", "colocated-0") or 0.0) < 6.0:
            assert time.monotonic() < deadline, "the 6-second step should be reported"
            time.sleep(0.1)
        assert "declared dead" not in cluster.log_tail("router", 10_000)
        assert cluster.pids["colocated-0"] == pid and "frozen" not in (tmp_path / "launcher.log").read_text()
        wait_for_idle_blocks(cluster.url, cluster.worker_names, NUM_BLOCKS)
    finally:
        cluster.stop()


def _stream_to_end(client, name: str, prompt: str, results: dict, key: str, streaming: set) -> None:
    text = ""
    try:
        for chunk in client.completions.create(model=name, prompt=prompt, max_tokens=STREAM_TOKENS, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}):
            text += chunk.choices[0].text
            streaming.add(key)
        results[key] = ("completed", time.monotonic(), text)
    except (openai.APIError, httpx.HTTPError) as exc:
        results[key] = ("error", time.monotonic(), repr(exc))


@pytest.mark.solo  # declared dead within the 1 s deadline (+2 s): timed on a machine to itself
def test_a_frozen_worker_is_declared_dead_and_its_streams_move_on(tiny_checkpoint, tmp_path, reference_text,
                                                                 monkeypatch):
    # 20 ms per step (a slower model): the streams are still under way, on both workers, when one freezes
    monkeypatch.setenv("TANDEM_TEST_STEP_DELAY_S", "0.02")
    cluster = start_cluster(tiny_checkpoint("llama"), tmp_path, num_prefill=0, num_decode=0, num_colocated=2,
                            config=FAST_LIVENESS, entry_module="tests.cluster.slow_steps")
    frozen = cluster.processes["colocated-1"]
    try:
        client = client_for(cluster)
        name = client.models.list().data[0].id
        results: dict = {}
        streaming: set = set()  # the streams that have their first tokens: one frozen mid-stream must migrate
        prompts = [f"story {i}" for i in range(4)]
        threads = [threading.Thread(target=_stream_to_end, args=(client, name, prompt, results, str(i), streaming),
                                    daemon=True) for i, prompt in enumerate(prompts)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 20
        while len(streaming) < len(prompts) or not worker_metric(cluster.url, "tandem_worker_running_requests",
                                                                 "colocated-1"):
            assert time.monotonic() < deadline, "no stream under way on colocated-1"
            time.sleep(0.05)
        frozen.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        assert not results, "every stream is still under way when the worker freezes"
        while workers_alive(cluster.url)["colocated-1"]:  # declared dead within the deadline (+ slack)
            assert time.monotonic() - stopped_at < 1.0 + 2.0, "the frozen worker was not declared dead in time"
            time.sleep(0.05)
        assert migrations(cluster.url) > 0, "its streams, under way, move on to the live worker"
        for thread in threads:
            thread.join(60)
        # the frozen worker's streams went on on the live one: every stream is transformers' exact text
        assert len(results) == 4 and all(r[0] == "completed" for r in results.values()), results
        for i, prompt in enumerate(prompts):
            ids = httpx.post(f"{cluster.url}/tokenize", json={"prompt": prompt}, timeout=5).json()["tokens"]
            assert results[str(i)][2] == reference_text(ids, STREAM_TOKENS)[1]
        assert not workers_alive(cluster.url)["colocated-1"]
        prompt = [12, 44, 91, 200]
        out = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == reference_text(prompt, 12)[1]  # served by the live worker meanwhile
        frozen.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while not workers_alive(cluster.url)["colocated-1"]:
            assert time.monotonic() < deadline, "a thawed worker heartbeats again and is admitted"
            time.sleep(0.1)
        wait_for_idle_blocks(cluster.url, cluster.worker_names, NUM_BLOCKS)  # its dead requests were cancelled
    finally:
        frozen.send_signal(signal.SIGCONT)
        cluster.stop()


def test_1p1d_without_a_prefill_worker_prefills_on_the_decode_worker(tiny_checkpoint, tmp_path, reference_text):
    forgetful = {**FAST_LIVENESS, "router": {**FAST_LIVENESS["router"], "forget_dead_worker_after_s": 3.0,
                                              "wait_for_worker_s": 3.0}}
    cluster = start_cluster(tiny_checkpoint("llama"), tmp_path, num_prefill=1, num_decode=1,
                            config=forgetful, max_restarts=0)
    try:
        client = client_for(cluster)
        name = client.models.list().data[0].id
        before = (worker_metric(cluster.url, "tandem_kv_transfer_bytes_total", "decode-0") or 0.0)
        prompt = [10 + (i * 13) % 280 for i in range(60)]
        out = client.completions.create(model=name, prompt=prompt, max_tokens=10, temperature=0)
        assert out.choices[0].text == reference_text(prompt, 10)[1]
        time.sleep(0.5)  # one heartbeat
        assert (worker_metric(cluster.url, "tandem_kv_transfer_bytes_total", "decode-0") or 0.0) > before  # via P
        cluster.kill("prefill-0", signal.SIGKILL)
        deadline = time.monotonic() + 10
        while workers_alive(cluster.url).get("prefill-0", False):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert httpx.get(f"{cluster.url}/ready").status_code == 200
        for i in range(3):
            prompt = [20 + (i * 31 + j * 17) % 270 for j in range(40 + 30 * i)]
            out = client.completions.create(model=name, prompt=prompt, max_tokens=10, temperature=0)
            assert out.choices[0].text == reference_text(prompt, 10)[1]
        wait_for_idle_blocks(cluster.url, ["decode-0"], NUM_BLOCKS)
        deadline = time.monotonic() + 10  # dead past forget_dead_worker_after_s: no longer listed anywhere
        while "prefill-0" in workers_alive(cluster.url):
            assert time.monotonic() < deadline, "a worker dead for good stays listed in /ready"
            time.sleep(0.2)
        assert worker_metric(cluster.url, "tandem_worker_up", "prefill-0") is None
        assert worker_metric(cluster.url, "tandem_worker_routed_prompt_tokens_total", "prefill-0") is None
        assert worker_metric(cluster.url, "tandem_worker_routed_prompt_tokens_total", "decode-0") is not None
        assert worker_metric(cluster.url, "tandem_worker_up", "decode-0") == 1.0
    finally:
        cluster.stop()


def test_short_prompts_are_prefilled_where_they_decode_and_long_ones_are_shipped(tiny_checkpoint, tmp_path,
                                                                                 reference_text):
    config = dict(FAST_LIVENESS, router={"dead_after_s": 1.0, "max_local_prefill_length": 32})
    cluster = start_cluster(tiny_checkpoint("llama"), tmp_path, num_prefill=1, num_decode=1, config=config)
    try:
        client = client_for(cluster)
        name = client.models.list().data[0].id

        def moved_bytes() -> float:
            time.sleep(0.6)  # heartbeats carry the transfer counters
            return worker_metric(cluster.url, "tandem_kv_transfer_bytes_total", "decode-0") or 0.0

        for num_prompt_tokens, is_local in [(24, True), (32, True), (120, False)]:
            before = moved_bytes()
            prompt = [10 + (i * 13) % 280 for i in range(num_prompt_tokens)]
            out = client.completions.create(model=name, prompt=prompt, max_tokens=10, temperature=0)
            assert out.choices[0].text == reference_text(prompt, 10)[1]
            assert (moved_bytes() == before) is is_local, f"{num_prompt_tokens} tokens"
        wait_for_idle_blocks(cluster.url, cluster.worker_names, NUM_BLOCKS)
    finally:
        cluster.stop()
