"""A frozen process is not left frozen: ``tandem up``'s launcher kills a worker or a router that gives no sign of
life for ``watchdog_timeout_s`` (here SIGSTOPped, so it neither exits nor answers) and restarts it; the cluster
serves again with the new process. The launcher's event names the freeze."""

from __future__ import annotations

import os
import signal
import time

import httpx

from tests.cluster.conftest import start_cluster, wait_for_incarnation


def wait_for_new_pid(cluster, name: str, old_pid: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while cluster.pids[name] == old_pid:
        assert time.monotonic() < deadline, f"{name} (pid {old_pid}) frozen for {timeout_s:g} s, not replaced"
        time.sleep(0.1)
    return cluster.pids[name]


def complete(url: str) -> None:
    name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    out = httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": [5, 6, 7], "max_tokens": 4,
                                                    "ignore_eos": True}, timeout=60)
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 4, out.text


def test_a_frozen_worker_and_a_frozen_router_are_killed_and_restarted(tiny_checkpoint, tmp_path):
    events = []
    cluster = start_cluster(tiny_checkpoint("llama"), tmp_path, num_prefill=0, num_decode=0, num_colocated=1,
                            max_restarts=2, watchdog_timeout_s=2, on_event=events.append)
    try:
        complete(cluster.url)
        frozen_pid = cluster.pids["colocated-0"]
        os.kill(frozen_pid, signal.SIGSTOP)
        new_pid = wait_for_new_pid(cluster, "colocated-0", frozen_pid, timeout_s=20)
        # the supervisor's step restarts the process before its thread hands that step's events on
        deadline = time.monotonic() + 10
        while not any(e.kind == "exited" for e in events):
            assert time.monotonic() < deadline, events
            time.sleep(0.05)
        [frozen] = [e for e in events if e.kind == "frozen"]
        assert frozen.message.startswith("colocated-0 gave no sign of life for ")
        assert "(it is stopped: SIGSTOP or a debugger)" in frozen.message and frozen.message.endswith("killing it")
        assert any(e.kind == "exited" and e.message.startswith("colocated-0 was killed: it gave no sign of life")
                   for e in events), events
        assert not os.path.exists(f"/proc/{frozen_pid}") or open(f"/proc/{frozen_pid}/stat").read().split()[2] == "Z"
        wait_for_incarnation(cluster.url, "colocated-0", new_pid, timeout_s=60)
        complete(cluster.url)

        router_pid = cluster.pids["router"]
        os.kill(router_pid, signal.SIGSTOP)
        wait_for_new_pid(cluster, "router", router_pid, timeout_s=20)
        assert any(e.kind == "frozen" and e.name == "router" for e in events)
        wait_for_incarnation(cluster.url, "colocated-0", new_pid, timeout_s=60)  # the worker re-registered
        complete(cluster.url)
    finally:
        cluster.stop()
    assert not cluster.watchdog.directory.exists()  # the signs of life go with the cluster
