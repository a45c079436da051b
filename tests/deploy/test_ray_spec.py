"""`tandem ray up`'s decisions made before Ray is touched: names, resources, per-node core plans, flags."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.cli import main
from deploy.ray_cluster import spec
from deploy.ray_cluster.spec import ProcessSpec
from tests.deploy.conftest import is_alive


def test_actor_names_round_trip_and_foreign_names_are_ignored():
    assert spec.actor_name("tandem", "prefill-0") == "tandem:prefill-0"
    assert spec.split_actor_name("blue-2:decode-3") == ("blue-2", "decode-3")
    assert spec.split_actor_name("tandem:router") == ("tandem", "router")
    for foreign in ("router", "tandem:my-actor", ":router", "serve:controller"):
        assert spec.split_actor_name(foreign) is None
    with pytest.raises(ValueError, match="--name"):
        spec.check_deployment_name("a:b")


def test_process_spec_command_lines():
    router = ProcessSpec("tandem", "router", {}, "/logs", 5, http_port=9000)
    assert router.role == "router" and router.cli_args("10.0.0.5") == ["router", "--host", "10.0.0.5", "--port", "9000"]
    assert ProcessSpec("tandem", "router", {}, "/l", 5, http_host="0.0.0.0").cli_args("10.0.0.5")[2] == "0.0.0.0"
    worker = ProcessSpec("tandem", "colocated-1", {}, "/logs", 5)
    assert worker.cli_args("x") == ["worker", "--role", "PrefillAndDecode", "--worker-id", "colocated-1"]
    assert ProcessSpec("t", "decode-0", {}, "/l", 1).actor_name == "t:decode-0"


def test_resources_become_ray_actor_options():
    assert spec.parse_resources('{"prefill": 1, "GPU": 2, "CPU": 4}', "--prefill-resources") == {
        "prefill": 1.0, "GPU": 2.0, "CPU": 4.0}
    options = spec.actor_options({"prefill": 1.0, "GPU": 2.0, "CPU": 4.0, "memory": 2e9})
    assert options == {"num_cpus": 4.0, "num_gpus": 2.0, "memory": 2000000000, "resources": {"prefill": 1.0}}
    assert spec.actor_options({}, spread=True) == {"num_cpus": 0, "scheduling_strategy": "SPREAD"}
    assert spec.actor_options({}, pin_to=spec.router_pin(None)) == {
        "num_cpus": 0, "resources": {"node:__internal_head__": 0.001}}
    assert spec.router_pin("10.0.0.7") == "node:10.0.0.7"
    for bad, message in [("{x", "not JSON"), ("[1]", "JSON object"), ('{"a": -1}', ">= 0"), ('{"a": true}', ">= 0")]:
        with pytest.raises(ValueError, match=message):
            spec.parse_resources(bad, "--decode-resources")


def test_worker_resources_by_role():
    prefill, decode = {"prefill": 1.0}, {"decode": 1.0}
    assert spec.worker_resources("prefill-0", 1, prefill, decode) == {"prefill": 1.0, "GPU": 1}
    assert spec.worker_resources("colocated-0", 0, prefill, decode) == {"decode": 1.0}
    assert spec.worker_resources("decode-0", 1, prefill, {"GPU": 2.0}) == {"GPU": 2.0}  # the role's own count wins


def test_core_plan_per_node_matches_tandem_up_on_each_node():
    where = {
        "router": {"node_id": "head", "cores": [0, 1, 2, 3]},
        "prefill-0": {"node_id": "head", "cores": [0, 1, 2, 3]},
        "decode-0": {"node_id": "head", "cores": [0, 1, 2, 3]},
        "prefill-1": {"node_id": "n2", "cores": [0, 1]},
        "decode-1": {"node_id": "n2", "cores": [0, 1]},
        "decode-2": {"node_id": "n2", "cores": [0, 1]},
        "colocated-0": {"node_id": "n3", "cores": [0, 1, 2]},
    }
    plan = spec.plan_node_cores(where)
    assert plan["prefill-0"] == [0, 1] and plan["decode-0"] == [2, 3]
    assert plan["router"] == [0, 1]  # beside the prefill worker, off the decode cores
    assert plan["prefill-1"] == [0] and plan["decode-1"] == [1] and plan["decode-2"] == [1]
    assert plan["colocated-0"] == [0, 1, 2]
    alone = spec.plan_node_cores({"router": {"node_id": "head", "cores": [0, 1]},
                                  "decode-0": {"node_id": "n2", "cores": [0, 1]}})
    assert "router" not in alone and alone["decode-0"] == [0, 1]  # a router alone on its node is not bound
    shared = spec.plan_node_cores(where, share=True)
    assert shared["prefill-0"] == shared["decode-0"] == [0, 1, 2, 3]
    limited = spec.plan_node_cores(where, pool_limit=[1, 2])
    assert limited["prefill-0"] == [1] and limited["decode-0"] == [2] and limited["colocated-0"] == [1, 2]


@pytest.mark.parametrize("argv, message", [
    (["ray", "up", "--zmq-endpoint-base", "ipc:///tmp/x"], "needs tcp"),
    (["ray", "up", "--prefill-resources", "{x"], "not JSON"),
    (["ray", "up", "--decode", "0"], "at least one decode"),
    (["ray", "up", "--name", "a:b"], "--name"),
    (["ray", "up", "--max-restarts", "-1"], "--max-restarts"),
    (["ray", "up", "--colocated", "1", "--tensor-parallel-size", "0"], "tensor_parallel_size"),
    (["ray", "up", "--ready-timeout", "-1"], "--ready-timeout: must be > 0 (got -1)"),
    (["ray", "up", "--prefill", "-1"], "--prefill"),
])
def test_bad_ray_up_flags_fail_before_ray_is_touched(argv, message, capsys):
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert message in error and error.startswith("tandem ray up: error: "), error


def test_no_cluster_at_the_address_is_a_quick_clear_error(capsys):
    pytest.importorskip("ray")
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again below: nobody listens there
    started = time.monotonic()
    assert main(["ray", "status", "--address", f"127.0.0.1:{port}"]) == 1
    assert "no Ray cluster at" in capsys.readouterr().err and time.monotonic() - started < 30


def test_a_guarded_process_dies_with_its_parent(tmp_path):
    """The parent-death guard: SIGKILL the parent, and the child (tandem's main) goes too."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", f"""
import os, subprocess, sys, time
env = dict(os.environ, TANDEM_DIE_WITH_PARENT=str(os.getpid()))
code = "from deploy.parent_guard import die_with_parent_if_asked as d; d(); import time; time.sleep(120)"
child = subprocess.Popen([sys.executable, "-c", code], env=env)
open({str(pid_file)!r}, "w").write(str(child.pid))
time.sleep(120)
"""], cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child_pid = int(pid_file.read_text())
        time.sleep(1.0)  # the child has run the guard by now (it is cheap)
        assert is_alive(child_pid)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while is_alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_alive(child_pid), "the child outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        if pid_file.exists() and pid_file.read_text() and is_alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_guard_refuses_a_malformed_pid_and_exits_when_the_parent_is_already_gone():
    from deploy.parent_guard import die_with_parent_if_asked

    with pytest.raises(ValueError, match="TANDEM_DIE_WITH_PARENT"):
        die_with_parent_if_asked({"TANDEM_DIE_WITH_PARENT": "abc"})
    die_with_parent_if_asked({})  # not asked: nothing happens
    code = "from deploy.parent_guard import die_with_parent_if_asked as d; d({'TANDEM_DIE_WITH_PARENT': '1'}); print('ran')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 1 and "ran" not in result.stdout  # our parent is not pid 1: it "already died"
