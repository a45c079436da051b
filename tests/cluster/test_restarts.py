"""Supervision on a real 2 prefill + 2 decode cluster: a killed process is restarted and serves again.

While a worker is down the cluster keeps serving (a prober sends a request every ~0.3 s throughout);
the streams that ran on a killed decode worker migrate to the other one and finish with exactly the
text they would have had (router.max_migrations). The restarted process
re-registers as a new incarnation (a new pid in /ready), takes new requests, and outputs stay exactly
transformers' greedy text.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest

from kv_transfer.shm_files import shared_kv_files_of
from tests.cluster.conftest import (model_name, 
    CLUSTER_CONFIG, migrations, start_cluster, wait_for_idle_blocks, wait_for_incarnation, wait_for_metric, worker_metric,
)
from tests.conftest import hf_greedy

NUM_BLOCKS = 2048  # two long streams fit on one decode worker: no preemption muddles the timing
CONFIG = {"kv_cache": {**CLUSTER_CONFIG["kv_cache"], "num_blocks": NUM_BLOCKS}, "router": CLUSTER_CONFIG["router"],
          "transfer": {"transport": "shm", "ttl_s": 3.0, "heartbeat_interval_s": 0.2}}
LONG_TOKENS = 600  # with 8 ms more per step, 4.8 s or more: still running when a worker dies, even on a busy machine
PROMPTS = [f"story number {i}: once upon a time" for i in range(4)]
# Five processes on 2 cores: with a torch thread per core each, two decode workers spin against each
# other and these streams take minutes instead of seconds.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "TANDEM_TEST_STEP_DELAY_S": "0.008"}


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, tmp_path_factory):
    events = []
    c = start_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp("logs-restarts"), num_prefill=2,
                      num_decode=2, config=CONFIG, max_restarts=3, on_event=events.append, env=WORKER_ENV,
                      entry_module="tests.cluster.slow_steps")
    c.events = events
    try:
        yield c
    finally:
        c.stop()
    leftovers = shared_kv_files_of(c.started_pids)  # restarted workers' too
    assert not leftovers, f"a shared KV cache outlived the cluster: {leftovers}"


@pytest.fixture(scope="module")
def hf(tiny_checkpoint, hf_reference):
    return hf_reference(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def long_reference(hf):
    """``long_reference(i)``: transformers' greedy text for PROMPTS[i], LONG_TOKENS tokens, EOS ignored."""
    model, tokenizer = hf
    cache: dict[int, str] = {}

    def get(i: int) -> str:
        if i not in cache:
            ids = hf_greedy(model, tokenizer(PROMPTS[i])["input_ids"], LONG_TOKENS)
            cache[i] = tokenizer.decode(ids, skip_special_tokens=True)
        return cache[i]

    return get


MIN_PROBES = 5


class Prober:
    """Sends a short greedy request every ~0.3 s from a thread and keeps every failure."""

    def __init__(self, client, tokenizer, reference_text):
        self._client, self._tokenizer, self._reference_text = client, tokenizer, reference_text
        self.num_ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        # At least MIN_PROBES answers, however quick the restart was (one probe routed to the dead
        # worker waits out the liveness deadline, so a fast restart leaves room for few probes).
        deadline = time.monotonic() + 30
        while self.num_ok + len(self.failures) < MIN_PROBES and time.monotonic() < deadline:
            time.sleep(0.1)
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self):
        name = model_name(self._client)
        i = 0
        while not self._stop.wait(0.3):
            prompt = f"probe {i}"
            i += 1
            try:
                out = self._client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
                want = self._reference_text(self._tokenizer(prompt)["input_ids"], 8)[1]
                if out.choices[0].text != want:
                    self.failures.append(f"{prompt!r}: {out.choices[0].text!r} != {want!r}")
                else:
                    self.num_ok += 1
            except openai.APIError as exc:
                self.failures.append(f"{prompt!r}: {exc!r}")


def start_long_streams(cluster, client) -> tuple[list[threading.Thread], dict, dict[str, int]]:
    """Four long greedy streams (ignore_eos), returned once all decode, on both decode workers.

    Returns the threads, results (results[i] = ("completed", text, finish, t) or ("error", repr, t)
    when stream i ends) and how many streams each decode worker runs."""
    name = model_name(client)
    results: dict = {}
    num_streaming = threading.Semaphore(0)

    def consume(i):
        text, finish = "", None
        try:
            for num_chunks, chunk in enumerate(client.completions.create(
                    model=name, prompt=PROMPTS[i], max_tokens=LONG_TOKENS, temperature=0, stream=True,
                    extra_body={"ignore_eos": True})):
                if num_chunks == 0:
                    num_streaming.release()
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            results[i] = ("completed", text, finish, time.monotonic())
        except openai.APIError as exc:
            results[i] = ("error", repr(exc), time.monotonic())

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for _ in threads:
        assert num_streaming.acquire(timeout=30), f"a stream did not start: {results}"
    deadline = time.monotonic() + 2
    while True:  # heartbeats lag: wait until the load reports show every stream
        running = {w: worker_metric(cluster.url, "tandem_worker_running_requests", w) for w in ("decode-0", "decode-1")}
        if sum(running.values()) == len(PROMPTS) and all(running.values()):
            return threads, results, running
        assert time.monotonic() < deadline, f"the streams should run on both decode workers: {running}"
        time.sleep(0.05)


def listens(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=1)
    except httpx.TransportError:
        return False
    return True


def route_a_batch(client, tokenizer, reference_text, tag: str, num_requests: int = 8) -> None:
    """Concurrent greedy requests (enough that every worker gets some), each exactly transformers' text."""
    name = model_name(client)
    prompts = [f"{tag} request {i} with a prompt long enough to be worth a transfer" for i in range(num_requests)]
    outputs: dict = {}

    def one(i):
        outputs[i] = client.completions.create(model=name, prompt=prompts[i], max_tokens=24, temperature=0)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(num_requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(outputs) == num_requests
    for i, out in outputs.items():
        assert out.choices[0].text == reference_text(tokenizer(prompts[i])["input_ids"], 24)[1]


def assert_restarted(cluster, name: str, old_pid: int, killed_at: float) -> int:
    # Read at least once: on a busy machine the streams joined before this may outlast the 30 s
    new_pid = cluster.pids[name]
    while time.monotonic() - killed_at < 30 and new_pid in (None, old_pid):
        time.sleep(0.1)
        new_pid = cluster.pids[name]
    assert new_pid not in (None, old_pid), f"{name} was not restarted"
    wait_for_incarnation(cluster.url, name, new_pid, timeout_s=max(5.0, 30 - (time.monotonic() - killed_at)))
    messages = [e.message for e in cluster.events if e.name == name]
    assert any("killed by signal SIGKILL; restarting" in m and f"{name}.log" in m for m in messages), messages
    assert any(f"restarted as pid {new_pid}" in m for m in messages), messages
    log = cluster.log_path(name).read_text()
    assert log.count(f"tandem: {name} restarted") >= 1 and "serving" in log.rsplit("restarted;", 1)[1]
    return new_pid


def test_killed_decode_worker_is_restarted_and_serves_again(cluster, client, hf, reference_text, long_reference):
    _, tokenizer = hf
    threads, results, running = start_long_streams(cluster, client)
    old_pid = cluster.pids["decode-0"]
    with Prober(client, tokenizer, reference_text) as prober:
        cluster.kill("decode-0", signal.SIGKILL)
        killed_at = time.monotonic()
        for t in threads:
            t.join(timeout=60)
        assert_restarted(cluster, "decode-0", old_pid, killed_at)
    assert not prober.failures and prober.num_ok >= MIN_PROBES, prober.failures

    # No stream dies with its worker: those on decode-0 moved to decode-1, which recomputed their prompt
    # and the tokens already sent and went on; every client saw transformers' exact text, nothing repeated.
    assert len(results) == len(PROMPTS) and all(r[0] == "completed" for r in results.values()), results
    for i, (_, text, finish, _) in results.items():
        assert finish == "length" and text == long_reference(i)
    assert migrations(cluster.url) == running["decode-0"]

    route_a_batch(client, tokenizer, reference_text, "after the decode restart")
    assert wait_for_metric(cluster.url, "tandem_kv_transfer_bytes_total", "decode-0", above=0), \
        "the restarted decode worker received no KV"
    assert wait_for_metric(cluster.url, "tandem_kv_transfer_busy_seconds_total", "decode-0", above=0)
    wait_for_idle_blocks(cluster.url, cluster.worker_names, NUM_BLOCKS, timeout_s=20)


def test_killed_prefill_worker_is_restarted_and_serves_again(cluster, client, hf, reference_text, long_reference):
    _, tokenizer = hf
    threads, results, _ = start_long_streams(cluster, client)
    old_pid = cluster.pids["prefill-0"]
    with Prober(client, tokenizer, reference_text) as prober:
        cluster.kill("prefill-0", signal.SIGKILL)
        killed_at = time.monotonic()
        for t in threads:
            t.join(timeout=60)
        assert_restarted(cluster, "prefill-0", old_pid, killed_at)
    assert not prober.failures and prober.num_ok >= MIN_PROBES, prober.failures

    # The streams were past prefill when it died: every one completes, exactly.
    assert len(results) == len(PROMPTS) and all(r[0] == "completed" for r in results.values()), results
    for i, (_, text, finish, _) in results.items():
        assert finish == "length" and text == long_reference(i)

    route_a_batch(client, tokenizer, reference_text, "after the prefill restart")
    assert wait_for_metric(cluster.url, "tandem_kv_transfer_bytes_total", "prefill-0", above=0), \
        "the restarted prefill worker sent no KV"
    wait_for_idle_blocks(cluster.url, cluster.worker_names, NUM_BLOCKS, timeout_s=20)


def test_killed_router_is_restarted_and_every_worker_registers_again(cluster, client, hf, reference_text):
    _, tokenizer = hf
    name, old_pid = model_name(client), cluster.pids["router"]
    cluster.kill("router", signal.SIGKILL)
    killed_at = time.monotonic()
    while cluster.pids["router"] == old_pid:
        assert time.monotonic() - killed_at < 10, "the router was not restarted"
        time.sleep(0.1)
    # a request sent the moment the new router listens, before its workers registered again, waits for them (it
    # got a 503 "no live workers" then)
    while not listens(cluster.url):
        assert time.monotonic() - killed_at < 30, "the restarted router does not listen"
        time.sleep(0.02)
    first = httpx.post(f"{cluster.url}/v1/completions", timeout=30, json={
        "model": name, "prompt": "the first request after a router restart", "max_tokens": 4})
    assert first.status_code == 200, first.text
    for name, pid in cluster.pids.items():  # workers re-register by themselves, as the same processes
        if name != "router":
            wait_for_incarnation(cluster.url, name, pid, timeout_s=30 - (time.monotonic() - killed_at))
    route_a_batch(client, tokenizer, reference_text, "after the router restart")
    wait_for_idle_blocks(cluster.url, cluster.worker_names, NUM_BLOCKS, timeout_s=20)
