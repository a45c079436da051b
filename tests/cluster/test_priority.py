"""Request priority on real processes: an urgent request jumps a queue of background work.

One colocated worker that runs one request at a time (``max_batch_size`` 1, ``scheduling_policy``
priority, no prefix cache) with every engine step made 0.1 s longer (``tests/cluster/slow_steps.py``: a
model big enough for steps to take real time). Background requests of priority 10 (short prompt, several
tokens each) keep it busy and fill the router's admission queue; then a priority-0 request with a long
prompt (its prefill alone takes a dozen steps) arrives. It must wait only for the request running when it came, not
for the queue: its TTFT stays within 2x of its TTFT on the idle cluster, it completes before every
background request queued ahead of it, and nothing fails.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

from tests.cluster.conftest import running_cluster

pytestmark = pytest.mark.solo  # compares TTFT idle vs under load: `make test` runs it with the machine to itself

STEP_DELAY_S = 0.1
NUM_BACKGROUND = 6  # one runs, the rest wait in the router's queue
BACKGROUND_PROMPT = list(range(20, 36))  # 16 tokens: one prefill step, then a step per token
BACKGROUND_TOKENS = 8
URGENT_PROMPT = [(7 * i) % 280 + 10 for i in range(384)]  # 12 prefill steps of 32 tokens
URGENT_TOKENS = 3
# no prefix cache: the urgent prompt's second run (under load) computes what its first (idle) did
PRIORITY_CONFIG = {"kv_cache": {"page_size": 4, "num_blocks": 512, "enable_prefix_caching": False},
                   "max_batch_size": 1, "max_batch_input_tokens": 32, "scheduling_policy": "priority"}


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, tmp_path_factory):
    with running_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp("logs-priority"), num_prefill=0,
                         num_decode=0, num_colocated=1, config=PRIORITY_CONFIG, entry_module="tests.cluster.slow_steps",
                         env={"TANDEM_TEST_STEP_DELAY_S": str(STEP_DELAY_S)}) as c:
        yield c


@dataclass
class Stream:
    status: int = 0
    ttft_s: float | None = None
    done_at: float | None = None  # time.monotonic() of the final event
    finish_reason: str | None = None
    num_tokens: int = 0


def stream(client: httpx.Client, name: str, prompt: list[int], max_tokens: int, priority: int) -> Stream:
    """One streamed completion (EOS ignored, so it runs ``max_tokens`` steps), timed on the client."""
    body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "priority": priority, "return_tokens_as_token_ids": True, "logprobs": 0}
    result, start = Stream(), time.monotonic()
    with client.stream("POST", "/v1/completions", json=body) as response:
        result.status = response.status_code
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):]).get("choices", []):
                tokens = choice["logprobs"]["tokens"] if choice.get("logprobs") else []
                if tokens and result.ttft_s is None:
                    result.ttft_s = time.monotonic() - start
                result.num_tokens += len(tokens)
                result.finish_reason = choice["finish_reason"] or result.finish_reason
    result.done_at = time.monotonic()
    return result


class Background:
    """``fn(*args)`` on a thread of its own; ``result()`` waits for it."""

    def __init__(self, fn, *args) -> None:
        self._out: list = []
        self._thread = threading.Thread(target=lambda: self._out.append(fn(*args)), daemon=True)
        self._thread.start()

    def result(self, timeout_s: float = 60.0):
        self._thread.join(timeout_s)
        assert self._out, "the request did not finish"
        return self._out[0]


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for(predicate, url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            lines = httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
            raise AssertionError("condition not reached; " + "; ".join(
                line for line in lines if "queue_depth" in line or "in_flight" in line or "requests_total" in line))
        time.sleep(0.02)


def test_an_urgent_request_jumps_the_queue_of_background_work(cluster):
    url = cluster.url
    client = httpx.Client(base_url=url, timeout=60)  # one connection pool: the background requests arrive at once
    name = client.get("/v1/models").json()["data"][0]["id"]
    stream(client, name, BACKGROUND_PROMPT, 2, 0)  # warm-up
    idle = stream(client, name, URGENT_PROMPT, URGENT_TOKENS, 0)
    assert idle.status == 200 and idle.ttft_s is not None

    background = []
    for i in range(NUM_BACKGROUND):
        background.append(Background(stream, client, name, BACKGROUND_PROMPT, BACKGROUND_TOKENS, 10))
        if i == 0:  # the first one takes the worker's only slot before the others queue
            wait_for(lambda: metric(url, "tandem_requests_in_flight") == 1, url)
    queued = 'tandem_router_priority_admission_queue_depth{priority="10+"}'
    wait_for(lambda: metric(url, queued) == NUM_BACKGROUND - 1, url)
    urgent = stream(client, name, URGENT_PROMPT, URGENT_TOKENS, 0)
    results = [job.result() for job in background]
    client.close()

    assert urgent.status == 200 and urgent.finish_reason == "length" and urgent.num_tokens == URGENT_TOKENS
    assert all(r.status == 200 and r.finish_reason == "length" and r.num_tokens == BACKGROUND_TOKENS
               for r in results), results
    assert urgent.ttft_s <= 2 * idle.ttft_s, f"TTFT {urgent.ttft_s:.2f}s under load vs {idle.ttft_s:.2f}s idle"
    queued_ahead = results[1:]  # the first was running when the urgent request arrived
    assert all(urgent.done_at < r.done_at for r in queued_ahead), "a background request finished first"
    assert metric(url, 'tandem_requests_total{outcome="ok"}') == NUM_BACKGROUND + 3
    print(f"priority-0 TTFT idle {idle.ttft_s:.3f}s, behind {NUM_BACKGROUND - 1} queued priority-10 requests "
          f"{urgent.ttft_s:.3f}s")
