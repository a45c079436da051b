"""One small P/D cluster for the observability tests (the dashboard on a real Prometheus, ``tandem top``):
1 prefill + 1 decode worker, every request through the prefill worker and a KV transfer."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from tests.cluster.conftest import running_cluster

NUM_BLOCKS = 512


@pytest.fixture(scope="package")
def cluster(tiny_checkpoint, tmp_path_factory):
    with running_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp("logs-observability"),
                         num_prefill=1, num_decode=1) as c:
        yield c


def put_load(url: str, num_rounds: int = 3, concurrency: int = 4, max_tokens: int = 12, pause_s: float = 0.5) -> int:
    """``num_rounds`` rounds of ``concurrency`` requests at once (short prompts, ``max_tokens`` tokens each,
    EOS ignored so every request decodes them all), ``pause_s`` apart; returns how many finished well."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    name = client.models.list().data[0].id
    finished = []

    def one(i: int) -> None:
        out = client.completions.create(model=name, prompt=[10 + i, 20 + i, 30, 40, 50 + i], max_tokens=max_tokens,
                                        temperature=0, extra_body={"ignore_eos": True})
        finished.append(out.choices[0].finish_reason)

    for round_index in range(num_rounds):
        threads = [threading.Thread(target=one, args=(round_index * concurrency + i,)) for i in range(concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        time.sleep(pause_s)
    return finished.count("length")


@pytest.fixture
def background_load(cluster):
    """``start(**put_load kwargs)`` runs ``put_load`` on a thread; joined (and its count checked) at the end."""
    threads, results = [], []

    def start(**kwargs) -> threading.Thread:
        thread = threading.Thread(target=lambda: results.append(put_load(cluster.url, **kwargs)), daemon=True)
        thread.start()
        threads.append(thread)
        return thread

    yield start
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == len(threads), "the load did not finish"
