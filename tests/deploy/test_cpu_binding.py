"""``tandem up`` binds its prefill and decode workers to disjoint cores (the router beside prefill); a
worker says where it runs."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.cluster.conftest import free_port
from tests.deploy.conftest import TANDEM, TandemUp


def allowed_cores_of_threads(pid: int) -> set[str]:
    """``Cpus_allowed_list`` of every thread of ``pid`` (OpenMP, ZMQ and tokenizer threads included)."""
    found = set()
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        for line in status.read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                found.add(line.split(":", 1)[1].strip())
    return found


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
def test_tandem_up_binds_prefill_and_decode_to_disjoint_cores(tiny_checkpoint, tmp_path):
    cores = sorted(os.sched_getaffinity(0))[:2]
    pool = f"{cores[0]},{cores[1]}"
    up = TandemUp(["--prefill", "1", "--decode", "1", "--cpu-cores", pool, "--num-threads", "1",
                   "--model", tiny_checkpoint("llama"), "--port", str(free_port()), "--log-dir", str(tmp_path),
                   "--kv-cache-num-blocks", "128"])
    try:
        plan = up.wait_for(r"^cpu plan: ", 30).string
        assert plan.strip() == (f"cpu plan: prefill-0: cores {cores[0]} (1 thread) | "
                                f"decode-0: cores {cores[1]} (1 thread) | router: cores {cores[0]}")
        url = up.wait_ready()
        out = httpx.post(f"{url}/v1/completions", json={"model": Path(tiny_checkpoint("llama")).name, "prompt": "Hi",
                                                        "max_tokens": 4, "ignore_eos": True}, timeout=60)
        assert out.status_code == 200, out.text  # after a request every worker thread has started
        assert allowed_cores_of_threads(up.pids["prefill-0"]) == {str(cores[0])}
        assert allowed_cores_of_threads(up.pids["decode-0"]) == {str(cores[1])}
        assert allowed_cores_of_threads(up.pids["router"]) == {str(cores[0])}  # beside prefill, off the decode core
        for name, core in (("prefill-0", cores[0]), ("decode-0", cores[1])):
            assert f"worker {name} placement: cores {core}, 1 torch thread" in (tmp_path / f"{name}.log").read_text()
        up.proc.send_signal(signal.SIGTERM)
        assert up.exit_code(timeout_s=60) == 0, up.output
    finally:
        up.cleanup()


@pytest.mark.parametrize(
    "args, message",
    [
        (["worker", "--role", "DecodeOnly", "--cpu-cores", "99"], "cpu_cores: core 99 not available to this process"),
        (["up", "--cpu-cores", "0,99"], "cpu_cores: core 99 not available to this process"),
        (["prefill", "--cpu-cores", "3-1"], "cpu_cores: descending range '3-1'"),
        (["decode", "--num-threads", "0"], "num_threads: Input should be greater than or equal to 1"),
    ],
)
def test_bad_placement_is_a_clear_error(args, message):
    result = subprocess.run([*TANDEM, *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    if "99" in message:
        assert "(available: " in result.stderr
