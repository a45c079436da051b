"""A rolling restart of every worker of a 2P2D cluster under a steady streaming load: each worker is
drained (SIGTERM: the router routes around it; a decode worker hands its streams, with their KV, to the
other one), replaced by a new process and re-registered before the next one goes. Zero failed requests,
every answer transformers' exact greedy text, no token recomputed, every worker a new pid, blocks back
to the start."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from tests.cluster.conftest import CLUSTER_CONFIG, openai_client, running_cluster, wait_for_idle_blocks
from tests.cluster.test_live_migration import metric

PROMPTS = [f"rolling story {i}: once upon a time" for i in range(6)]
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, tmp_path_factory):
    events = []
    config = {"drain_timeout_s": 1.0, "transfer": {"heartbeat_interval_s": 0.2}}
    with running_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp("rolling"), num_prefill=2, num_decode=2,
                         config=config, on_event=events.append, entry_module="tests.cluster.slow_steps",
                         env={"TANDEM_TEST_STEP_DELAY_S": "0.01", "OMP_NUM_THREADS": "1"}) as c:
        c.events = events
        yield c


def test_a_rolling_restart_under_load_fails_nothing(cluster, hf_reference, tiny_checkpoint, reference_text):
    _, tokenizer = hf_reference(tiny_checkpoint("llama"))
    want = {p: reference_text(tokenizer(p)["input_ids"], MAX_TOKENS)[1] for p in PROMPTS}
    client = openai_client(cluster)
    name = client.models.list().data[0].id
    stop = threading.Event()
    outcomes: list[tuple[str, str]] = []  # (prompt, text) or ("error", repr)

    def load(worker: int) -> None:
        i = worker
        while not stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            i += 3
            try:
                text = "".join(chunk.choices[0].text for chunk in client.completions.create(
                    model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                    extra_body={"ignore_eos": True}))
                outcomes.append((prompt, text))
            except openai.APIError as exc:
                outcomes.append(("error", repr(exc)))

    threads = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(3)]
    for t in threads:
        t.start()
    old_pids = {w: cluster.pids[w] for w in cluster.worker_names}
    cluster.rolling_restart()
    deadline = time.monotonic() + 60  # a fast restart may end before the load has answered a few streams
    while len(outcomes) < 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    errors = [o for o in outcomes if o[0] == "error"]
    assert not errors, errors
    assert len(outcomes) >= 6
    for prompt, text in outcomes:
        assert text == want[prompt]
    assert all(cluster.pids[w] != old_pids[w] for w in cluster.worker_names)
    assert metric(cluster.url, "tandem_migrations_total", '{cause="drain"}') >= 1  # streams moved with their KV
    assert metric(cluster.url, "tandem_migration_recomputed_tokens_total") == 0
    replaced = [e for e in cluster.events if e.kind == "replaced"]
    assert sorted(e.name for e in replaced) == sorted(cluster.worker_names)
    wait_for_idle_blocks(cluster.url, cluster.worker_names, CLUSTER_CONFIG["kv_cache"]["num_blocks"], timeout_s=20)
