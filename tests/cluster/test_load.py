"""Load is not a fault: a mixed workload on real processes, with steps longer than the liveness deadline.

Every engine step that runs a long prompt chunk burns extra CPU (``tests/cluster/slow_steps.py``: a
stand-in for a model whose long prefill takes seconds on this CPU), longer than the router's
``dead_after_s``. Requests arrive as a Poisson process, 30 % long-prompt/short-output among
short-prompt/long-output ones, on colocated and 1P1D clusters, on an idle machine and beside a busy
loop. Every request must succeed with transformers' greedy text, no worker may be declared dead, and
every worker's KV blocks must return to the start value.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.cluster.conftest import start_cluster, wait_for_idle_blocks, worker_metric
from tests.cluster.load_client import CpuHog, mixed_workload, run_load

NUM_BLOCKS = 2048
DEAD_AFTER_S = 1.0
SLOW_STEP_S = 1.3  # > DEAD_AFTER_S: a step the old in-loop heartbeat could not survive
LOAD_CONFIG = {
    "kv_cache": {"page_size": 4, "num_blocks": NUM_BLOCKS},
    "max_batch_input_tokens": 512,
    "transfer": {"heartbeat_interval_s": 0.2},
    "router": {"dead_after_s": DEAD_AFTER_S},
}
SHAPES = {
    "colocated": dict(num_prefill=0, num_decode=0, num_colocated=1),
    "1p1d": dict(num_prefill=1, num_decode=1),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def slow_cluster(request, tiny_checkpoint, tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("TANDEM_TEST_SLOW_STEP_S", str(SLOW_STEP_S))
    patch.setenv("TANDEM_TEST_SLOW_MIN_CHUNK", "200")
    c = start_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp(f"logs-load-{request.param}"),
                      config=LOAD_CONFIG, entry_module="tests.cluster.slow_steps", **SHAPES[request.param])
    try:
        yield c
    finally:
        c.stop()
        patch.undo()


def model_name(url: str) -> str:
    return httpx.get(f"{url}/v1/models").json()["data"][0]["id"]


@pytest.mark.parametrize("machine", ["idle", "cpu-hog"])
def test_mixed_load_fails_nothing_and_stays_exact(slow_cluster, machine, reference_text):
    requests = mixed_workload(14, rate=2.0, long_fraction=0.3, long_len=300, long_out=8, short_len=16,
                              short_out=32, seed=len(machine))
    assert sum(len(r.prompt_ids) >= 200 for r in requests) >= 3
    if machine == "cpu-hog":
        with CpuHog():
            results = run_load(slow_cluster.url, model_name(slow_cluster.url), requests)
    else:
        results = run_load(slow_cluster.url, model_name(slow_cluster.url), requests)

    failed = [(r.status_code, r.error) for r in results if not r.is_ok]
    assert failed == [], f"{len(failed)} of {len(results)} requests failed under load"
    for result in results:
        _, want_text = reference_text(result.request.prompt_ids, result.request.max_tokens)
        assert result.text == want_text
    router_log = slow_cluster.log_tail("router", 10_000)
    assert "declared dead" not in router_log, "a busy worker was declared dead"
    longest = max((worker_metric(slow_cluster.url, "tandem_worker_max_step_seconds", w) or 0.0)
                  for w in slow_cluster.worker_names)
    assert longest > DEAD_AFTER_S, "the load never produced a step longer than the liveness deadline"
    wait_for_idle_blocks(slow_cluster.url, slow_cluster.worker_names, NUM_BLOCKS)


async def _post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(client.post(f"{url}/v1/completions", json=b) for b in bodies))


def test_saturation_answers_200_or_429_and_every_200_is_exact(tiny_checkpoint, tmp_path, reference_text):
    config = {"kv_cache": {"page_size": 4, "num_blocks": 512}, "max_batch_size": 2,
              "router": {"max_queued_requests": 3}}
    cluster = start_cluster(tiny_checkpoint("llama"), tmp_path, num_prefill=0, num_decode=0, num_colocated=1,
                            config=config)
    try:
        name = model_name(cluster.url)
        prompts = [[11 + i, 40 + i, 99, 7 + i] for i in range(24)]
        bodies = [{"model": name, "prompt": p, "max_tokens": 24, "temperature": 0, "stream": i % 2 == 0}
                  for i, p in enumerate(prompts)]
        responses = asyncio.run(_post_all(cluster.url, bodies))
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 429}, statuses
        assert statuses.count(429) > 0 and statuses.count(200) >= 5  # 2 running + 3 queued at least
        for prompt, body, response in zip(prompts, bodies, responses):
            if response.status_code == 429:
                assert int(response.headers["retry-after"]) >= 1
                assert response.json()["error"]["message"]
                continue
            want = reference_text(prompt, 24)[1]
            if body["stream"]:
                events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
                text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
            else:
                text = response.json()["choices"][0]["text"]
            assert text == want
        wait_for_idle_blocks(cluster.url, cluster.worker_names, 512)
    finally:
        cluster.stop()
