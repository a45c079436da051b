"""Queue-aware conditional disaggregation on a real 1P1D cluster: with ``router.prefill_spill_tokens`` a burst's
prompts go partly to the prefill worker and partly to the decode worker, which prefills them in chunks of at most
``max_prefill_tokens_beside_decodes`` tokens beside its decodes; every stream is transformers' greedy text, and
every KV block comes back."""

from __future__ import annotations

import httpx
import pytest

from tests.cluster.conftest import (CLUSTER_CONFIG, check_concurrent_greedy_streams, running_cluster,
                                    wait_for_idle_blocks)

SPILL = {"router": {"prefill_spill_tokens": 0, "max_local_prefill_length": 0}, "max_prefill_tokens_beside_decodes": 8}


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, tmp_path_factory):
    with running_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp("logs-spill"), num_prefill=1,
                         num_decode=1, config=SPILL) as c:
        yield c


def _counter(url: str, name: str) -> float:
    lines = [line for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[-1])


def test_a_burst_is_shared_between_prefill_and_decode_workers_and_stays_exact(cluster, reference_text):
    check_concurrent_greedy_streams(cluster.url, reference_text, 32, seed=3)
    spilled = _counter(cluster.url, "tandem_prefill_spills_total")
    via_prefill_worker = _counter(cluster.url, "tandem_prefill_first_tokens_total")
    assert spilled > 0 and via_prefill_worker > 0, (spilled, via_prefill_worker)
    wait_for_idle_blocks(cluster.url, cluster.worker_names, CLUSTER_CONFIG["kv_cache"]["num_blocks"])
