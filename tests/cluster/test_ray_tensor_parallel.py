"""`tandem ray up --colocated 1 --tensor-parallel-size 2` on a real Ray head (loopback, 2 CPUs, stopped by pid).

The worker's ranks are reserved as one placement group (one bundle of 2 CPUs, STRICT_PACK) that its supervisor
actor runs in; rank 0 gets the node's two cores and gives one to each rank. Streams through the router are
transformers' greedy text and /ready lists the worker's rank pids. The group holds the node's CPUs, so a second
TP 2 deployment is not placed, and one of 4 ranks is refused up front. A killed rank, and a killed supervisor
actor, and a rolling restart bring the worker back in the same group, each rank on its core again; `tandem ray down` removes the group and every process. Then a
prefill worker of 2 ranks (its own group) feeds a decode worker of 1 with transformers' text.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster.conftest import (CLUSTER_CONFIG, PROMPT_TOKENS_COMPUTED, check_concurrent_greedy_streams,
                                    wait_for_idle_blocks, wait_for_metric)
from tests.pipeline.test_tensor_parallel import is_running, wait_gone
from tests.cluster.test_ray_deploy import status
from tests.ray_support import RayHead, free_ports, processes_mentioning, tandem_ray_deployment

pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # about 2 minutes on 2 cores: a Ray head, a TP 2 worker started three times

TANDEM = str(Path(sys.executable).with_name("tandem"))
WORKER = "colocated-0"
GROUP = f"tandem:{WORKER}"
CONFIG_FLAGS = ["--kv-cache-page-size", str(CLUSTER_CONFIG["kv_cache"]["page_size"]),
                "--kv-cache-num-blocks", str(CLUSTER_CONFIG["kv_cache"]["num_blocks"]),
                "--max-batch-input-tokens", str(CLUSTER_CONFIG["max_batch_input_tokens"])]
PLACEMENT_GROUPS = ("import json, logging, ray; ray.init(namespace='tandem', logging_level=logging.ERROR); "
                    "print(json.dumps([g for g in ray.util.placement_group_table().values() "
                    "if g['state'] != 'REMOVED']))")


@pytest.fixture(scope="module")
def head():
    with RayHead(num_cpus=2) as ray_head:
        yield ray_head
    assert not processes_mentioning(ray_head.temp_dir), "a Ray process of the test head survived its stop"


@pytest.fixture(scope="module")
def deployment(head, tiny_checkpoint, tmp_path_factory):
    with tandem_ray_deployment(head, TANDEM, tmp_path_factory.mktemp("ray-tp-logs"), "--colocated", "1",
                               "--tensor-parallel-size", "2", "--model", tiny_checkpoint("llama"), "--max-restarts", "3",
                               "--ready-timeout", "240", *CONFIG_FLAGS) as info:
        yield info


def placement_groups(head) -> list[dict]:
    """Every live placement group on the cluster, as Ray's table has them."""
    result = head.run(sys.executable, "-c", PLACEMENT_GROUPS, timeout_s=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def worker_entry(url: str) -> dict:
    """The TP worker's entry in the router's /ready: ``pid`` (rank 0) and ``rank_pids`` (rank 1)."""
    return {w["worker_id"]: w for w in httpx.get(f"{url}/ready", timeout=5).json()["workers"]}[WORKER]


def wait_back(head, deployment: dict, old: dict, timeout_s: float = 120) -> dict:
    """Once the worker ``old`` (a /ready entry) is replaced: none of its processes left, the new one alive in
    the router's view with a live rank 1 of its own. Returns the new entry."""
    assert wait_gone([old["pid"], *old["rank_pids"]], timeout_s=60) == []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            entry = worker_entry(deployment["url"])
        except (httpx.HTTPError, KeyError):
            entry = {}
        if (entry.get("alive") and entry["pid"] != old["pid"] and len(entry["rank_pids"]) == 1
                and all(is_running(pid) for pid in [entry["pid"], *entry["rank_pids"]])):
            deployment["pids"].update([entry["pid"], *entry["rank_pids"]])
            return entry
        time.sleep(0.5)
    raise AssertionError(f"{WORKER} was not back with both ranks within {timeout_s:g} s: {status(head)}")


def assert_in_its_group(head, group_id: str | None = None) -> dict:
    """The worker's status row shows its group: one bundle of 2 CPUs, STRICT_PACK, reserved (same id if given)."""
    row = status(head)[WORKER]
    group = row["placement_group"]
    assert group["name"] == GROUP and group["state"] == "CREATED" and group["strategy"] == "STRICT_PACK", group
    assert group["bundle"] == {"CPU": 2.0} and row["node_id"] == group["node_id"] and row["num_ranks"] == 2, row
    [table_entry] = [g for g in placement_groups(head) if g["name"] == GROUP]
    assert group_id in (None, table_entry["placement_group_id"])
    return table_entry


def test_up_places_the_ranks_in_one_group_and_serves_transformers_text(head, deployment, reference_text):
    up = deployment["up"]
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"{WORKER}: node 127.0.0.1, cores 0-1 (rank 0: 0; rank 1: 1), placement group {GROUP} {{CPU: 2}}" in up.stdout
    deployment["group_id"] = assert_in_its_group(head)["placement_group_id"]
    check_concurrent_greedy_streams(deployment["url"], reference_text, num_requests=6, seed=5)
    entry = worker_entry(deployment["url"])
    [rank1] = entry["rank_pids"]
    assert entry["pid"] == status(head)[WORKER]["pid"] and is_running(rank1)
    assert_one_core_per_rank(entry)
    deployment["pids"].update([entry["pid"], rank1])


def assert_one_core_per_rank(entry: dict) -> None:
    """Rank 0 on the first of the two cores Ray's reservation stands for, rank 1 on the second."""
    if len(os.sched_getaffinity(0)) >= 2:
        assert [sorted(os.sched_getaffinity(pid)) for pid in [entry["pid"], *entry["rank_pids"]]] == [[0], [1]]


def test_the_group_holds_its_cpus_and_what_cannot_be_placed_is_refused(head, deployment):
    port = str(free_ports(1)[0])
    second = head.run(TANDEM, "ray", "up", "--name", "second", "--colocated", "1", "--tensor-parallel-size", "2",
                      "--port", port, "--log-dir", deployment["log_dir"], "--ready-timeout", "3", timeout_s=120)
    assert second.returncode == 1 and "could not place colocated-0" in second.stderr, second.stderr
    assert "placement group" in second.stderr  # the node's 2 CPUs are the first deployment's
    too_big = head.run(TANDEM, "ray", "up", "--name", "big", "--colocated", "1", "--tensor-parallel-size", "4",
                       "--port", port, "--log-dir", deployment["log_dir"], timeout_s=120)
    assert too_big.returncode == 1 and "--tensor-parallel-size: colocated-0 runs its ranks on one node" in too_big.stderr
    assert [g["name"] for g in placement_groups(head)] == [GROUP]  # neither left a group (nor an actor) behind
    assert set(status(head)) == {"router", WORKER}


def test_a_killed_rank_brings_the_worker_back_in_the_same_group(head, deployment, reference_text):
    before = worker_entry(deployment["url"])
    os.kill(before["rank_pids"][0], signal.SIGKILL)  # rank 0 notices, exits, and its supervisor restarts it
    assert_one_core_per_rank(wait_back(head, deployment, before))
    assert_in_its_group(head, deployment["group_id"])
    check_concurrent_greedy_streams(deployment["url"], reference_text, num_requests=4, seed=6)


def test_a_rolling_restart_replaces_the_worker_in_the_same_group(head, deployment, reference_text):
    before = worker_entry(deployment["url"])
    result = head.run(TANDEM, "ray", "restart", "--timeout", "120", timeout_s=200)
    assert result.returncode == 0 and "replaced 1 workers" in result.stdout, result.stdout + result.stderr
    assert_one_core_per_rank(wait_back(head, deployment, before))
    assert_in_its_group(head, deployment["group_id"])


def test_a_killed_supervisor_is_restarted_by_ray_in_the_same_group(head, deployment, reference_text):
    row = status(head)[WORKER]
    before = worker_entry(deployment["url"])
    os.kill(row["actor_pid"], signal.SIGKILL)  # its worker and ranks die with it; Ray restarts it in its bundle
    assert_one_core_per_rank(wait_back(head, deployment, before))  # same node: the same cores, one per rank
    after = status(head)[WORKER]
    assert after["actor_pid"] != row["actor_pid"] and after["cores"] == row["cores"] == "0-1"
    assert any("on cores 0-1, planned for this node" in event for event in after["events"]), after
    assert_in_its_group(head, deployment["group_id"])
    check_concurrent_greedy_streams(deployment["url"], reference_text, num_requests=4, seed=7)
    wait_for_idle_blocks(deployment["url"], [WORKER], CLUSTER_CONFIG["kv_cache"]["num_blocks"])


def test_down_removes_the_group_and_every_process(head, deployment):
    result = head.run(TANDEM, "ray", "down", "--name", "tandem", timeout_s=120)
    assert result.returncode == 0 and "2 processes" in result.stdout, result.stdout + result.stderr
    assert status(head) == {}
    assert placement_groups(head) == []
    assert not [pid for pid in deployment["pids"] if is_running(pid)]
    assert not processes_mentioning(deployment["log_dir"])


def test_a_prefill_worker_of_two_ranks_feeds_a_decode_worker_of_one(head, tiny_checkpoint, reference_text, tmp_path):
    """P/D across layouts on Ray: prefill-0 (2 ranks) in its group, decode-0 (1 rank) beside it; every prompt is
    prefilled remotely and its KV re-sliced for the decode worker; the text is transformers'."""
    http_port, zmq_port = free_ports(2)
    up = head.run(TANDEM, "ray", "up", "--name", "pd", "--prefill", "1", "--decode", "1",
                  "--prefill-tensor-parallel-size", "2", "--model", tiny_checkpoint("llama"), "--port", str(http_port),
                  "--zmq-port", str(zmq_port), "--log-dir", str(tmp_path), "--max-restarts", "0",
                  "--router-max-local-prefill-length", "0", "--ready-timeout", "240", *CONFIG_FLAGS, timeout_s=300)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "placement group pd:prefill-0 {CPU: 2}" in up.stdout and "pd:decode-0" not in up.stdout
        url = f"http://127.0.0.1:{http_port}"
        check_concurrent_greedy_streams(url, reference_text, num_requests=4, seed=8)
        assert wait_for_metric(url, PROMPT_TOKENS_COMPUTED, "prefill-0", above=0)  # prefilled by the 2-rank worker
        workers = {w["worker_id"]: w for w in httpx.get(f"{url}/ready", timeout=5).json()["workers"]}
        assert len(workers["prefill-0"]["rank_pids"]) == 1 and workers["decode-0"]["rank_pids"] == []
    finally:
        down = head.run(TANDEM, "ray", "down", "--name", "pd", timeout_s=120)
    assert down.returncode == 0, down.stderr
    assert placement_groups(head) == [] and not processes_mentioning(str(tmp_path))
