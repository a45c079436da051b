"""No stream dies with its worker, on a colocated pair: SIGKILL the worker serving streams mid-answer
and each stream moves to the other worker, which recomputes its prompt and the tokens already sent and
goes on. Greedy, seeded sampling with penalties and a JSON schema all end with exactly the text of
the same request run without a kill. Usage counts stay right and blocks return to the start.
(The 2 prefill + 2 decode case is tests/cluster/test_restarts.py.)"""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.cluster.conftest import (CLUSTER_CONFIG, migrations, openai_client, running_cluster,
                                    wait_for_idle_blocks, wait_for_restart, worker_metric)

SCHEMA = {"type": "object", "required": ["name", "tags"], "additionalProperties": False, "properties": {
    "name": {"type": "string", "maxLength": 40}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                          "maxItems": 30}}}
STREAMS = {
    "greedy-0": dict(prompt="once upon a time", temperature=0.0, max_tokens=160, extra_body={"ignore_eos": True}),
    # every stream must show text early, since the kill waits for 10 chunks of each: on the tiny random model
    # "the quick brown fox" continues with ~100 byte tokens that complete no UTF-8 character, which the
    # detokenizer rightly holds back, so its first chunk came ~3 s in, near its end, and the kill with it
    "greedy-1": dict(prompt="a b c d", temperature=0.0, max_tokens=160, extra_body={"ignore_eos": True}),
    "seeded": dict(prompt="numbers: 1 2 3", temperature=1.0, seed=9, max_tokens=160, presence_penalty=0.5,
                   extra_body={"ignore_eos": True, "min_tokens": 150}),
    "schema": dict(prompt="json:", temperature=1.0, seed=4, max_tokens=200,
                   extra_body={"structured_outputs": {"json": SCHEMA}}),
}


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, tmp_path_factory):
    # slow steps: a stream of 160 tokens runs for seconds, long enough to kill its worker mid-answer
    with running_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp("migration"), num_prefill=0,
                         num_decode=0, num_colocated=2, max_restarts=2, entry_module="tests.cluster.slow_steps",
                         env={"TANDEM_TEST_STEP_DELAY_S": "0.02", "OMP_NUM_THREADS": "1"}) as c:
        yield c


def busiest_worker(cluster, num_streams: int, timeout_s: float = 30.0) -> str:
    """The worker running the most streams, once the workers' reports (their stats, seconds apart) show all
    ``num_streams``: read earlier, a busy machine's stale zeros picked a worker with none, and nothing moved."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = {w: worker_metric(cluster.url, "tandem_worker_running_requests", w) or 0
                   for w in cluster.worker_names}
        if sum(running.values()) >= num_streams or time.monotonic() > deadline:
            return max(running, key=running.get)
        time.sleep(0.1)


def test_streams_outlive_their_worker(cluster):
    client = openai_client(cluster)
    name = client.models.list().data[0].id

    def uninterrupted(body):  # the answer without a kill (non-streamed; the same tokens)
        out = client.completions.create(model=name, **body)
        return out.choices[0].text, out.usage.completion_tokens, out.usage.prompt_tokens

    with ThreadPoolExecutor(len(STREAMS)) as pool:  # at once: 160 slow steps each, batched as the streams are
        want = dict(zip(STREAMS, pool.map(uninterrupted, STREAMS.values())))
    results: dict[str, tuple] = {}
    started = threading.Semaphore(0)

    def consume(key):
        text, usage, chunks = "", None, 0
        try:
            for chunk in client.completions.create(model=name, stream=True, stream_options={"include_usage": True},
                                                   **STREAMS[key]):
                if chunk.choices:
                    text += chunk.choices[0].text
                    chunks += 1
                    if chunks == 10:
                        started.release()
                usage = chunk.usage or usage
            results[key] = ("completed", text, usage.completion_tokens, usage.prompt_tokens)
        except openai.APIError as exc:
            results[key] = ("error", repr(exc))

    threads = [threading.Thread(target=consume, args=(key,), daemon=True) for key in STREAMS]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=60), f"a stream did not start: {results}"
    victim = busiest_worker(cluster, len(STREAMS))
    old_pid = cluster.pids[victim]
    cluster.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(timeout=120)
    assert all(r[0] == "completed" for r in results.values()), results
    for key, (_, text, completion_tokens, prompt_tokens) in results.items():
        assert (text, completion_tokens, prompt_tokens) == want[key], key  # nothing repeated or missing; usage right
    jsonschema.validate(json.loads(results["schema"][1]), SCHEMA)
    assert migrations(cluster.url) >= 1
    wait_for_restart(cluster, victim, old_pid, timeout_s=30)
    wait_for_idle_blocks(cluster.url, cluster.worker_names, CLUSTER_CONFIG["kv_cache"]["num_blocks"], timeout_s=20)
