"""``tandem up`` keeps the service up: it restarts a killed worker (and says so), gives up with a clear
error and a non-zero exit only when the cluster cannot serve, on SIGTERM lets a running stream finish, and
takes every process down with it when it is killed."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.cluster.conftest import free_port, wait_for_incarnation
from tests.deploy.conftest import TandemUp, cluster_processes, is_alive


def up_args(tiny_checkpoint, tmp_path, *args: str) -> list[str]:
    return ["--model", tiny_checkpoint("llama"), "--port", str(free_port()), "--log-dir", str(tmp_path),
            "--kv-cache-num-blocks", "128", *args]


def complete(url: str, tiny_checkpoint, prompt: str = "Hi") -> None:
    out = httpx.post(f"{url}/v1/completions", json={"model": Path(tiny_checkpoint("llama")).name, "prompt": prompt,
                                                    "max_tokens": 4, "ignore_eos": True}, timeout=60)
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 4, out.text


def test_killed_worker_is_restarted_and_the_cluster_keeps_serving(tiny_checkpoint, tmp_path):
    up = TandemUp(up_args(tiny_checkpoint, tmp_path, "--prefill", "1", "--decode", "2"))
    try:
        url = up.wait_ready()
        old_pid = up.pids["decode-0"]
        os.kill(old_pid, signal.SIGKILL)
        line = up.wait_for(r"^decode-0 ", 10).string
        assert "decode-0 was killed by signal SIGKILL; restarting now (attempt 1 of 5)" in line
        assert f"log: {tmp_path}/decode-0.log" in line
        complete(url, tiny_checkpoint, "while decode-0 is down")  # decode-1 serves (after a retry, if need be)
        new_pid = int(up.wait_for(r"^decode-0 restarted as pid (\d+)", 30).group(1))
        assert not list(Path("/dev/shm").glob(f"tandem-kv.{old_pid}.*"))  # its shared KV cache reclaimed
        wait_for_incarnation(url, "decode-0", new_pid, timeout_s=30)
        complete(url, tiny_checkpoint, "after the restart")
        assert "tandem: decode-0 restarted" in (tmp_path / "decode-0.log").read_text()  # appended, marked
        assert "decode-0 restarted as pid" in (tmp_path / "launcher.log").read_text()
        children = cluster_processes(up.proc.pid)
        assert new_pid in children and old_pid not in children and len(children) == 4
        up.proc.send_signal(signal.SIGTERM)
        assert up.exit_code(timeout_s=60) == 0, up.output
        assert not [pid for pid in children if is_alive(pid)]
    finally:
        up.cleanup()


@contextlib.contextmanager
def busy_machine(is_busy: bool):
    """As many spinning processes as cores while the block runs (or nothing)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)] \
        if is_busy else []
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def started_pid(log_dir: Path, name: str) -> int | None:
    """The pid ``name`` was last started as (the launcher writes every start to launcher.log)."""
    path = log_dir / "launcher.log"
    found = re.findall(rf"^\S+ \S+ {re.escape(name)} started as pid (\d+)$", path.read_text() if path.exists() else "",
                       flags=re.MULTILINE)
    return int(found[-1]) if found else None


# busy: the same race on a loaded machine, in the slow lane (suite time: 24 s)
@pytest.mark.parametrize("is_busy", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["quiet", "busy"])
def test_a_worker_killed_as_the_router_turns_ready_is_restarted(tiny_checkpoint, tmp_path, is_busy):
    """The router serves from its first /ready 200, while ``tandem up`` may still wait for other workers
    to register: a worker killed then is restarted like any later crash, never a start-up failure that
    stops the cluster. Also: a request without max_tokens runs to the end of the context (the launcher
    passes on only what the operator set, so the API's default is the workers' rest-of-context)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["--model", tiny_checkpoint("llama"), "--port", str(port), "--log-dir", str(tmp_path),
            "--kv-cache-num-blocks", "128", "--max-length", "40", "--prefill", "1", "--decode", "2"]
    up = None
    try:  # whatever fails, the cluster goes (cleanup kills what is left)
        with busy_machine(is_busy):
            up = TandemUp(args)
            deadline = time.monotonic() + 240
            while True:
                assert time.monotonic() < deadline and up.proc.poll() is None, up.output
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                        break
                time.sleep(0.02)
            ready_body = httpx.get(f"{url}/ready", timeout=5).json()
            victim = "decode-1" if "decode-1" not in {w["worker_id"] for w in ready_body["workers"]} else "decode-0"
            victim_pid = started_pid(tmp_path, victim)
            os.kill(victim_pid, signal.SIGKILL)
            line = up.wait_for(rf"^{victim} ", 60).string
            assert f"{victim} was killed by signal SIGKILL; restarting now" in line, up.output
            new_pid = int(up.wait_for(rf"^{victim} restarted as pid (\d+)", 60).group(1))
            wait_for_incarnation(url, victim, new_pid, timeout_s=120)
            if "Tandem is ready at" not in up.output:  # the kill may have come before the launcher said so
                up.wait_for("Tandem is ready at", 240)
            assert up.proc.poll() is None, up.output
            assert not list(Path("/dev/shm").glob(f"tandem-kv.{victim_pid}.*"))
        complete(url, tiny_checkpoint)
        prompt_ids = [5, 6, 7, 8]
        out = httpx.post(f"{url}/v1/completions", json={"model": Path(tiny_checkpoint("llama")).name,
                                                         "prompt": prompt_ids, "ignore_eos": True}, timeout=60)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 40 - len(prompt_ids), out.text
        up.proc.send_signal(signal.SIGTERM)
        assert up.exit_code(timeout_s=60) == 0, up.output
    finally:
        if up is not None:
            up.cleanup()


def test_a_killed_launcher_takes_every_process_down(tiny_checkpoint, tmp_path):
    """SIGKILL of ``tandem up`` itself (no drain possible): its processes, a restarted one included, get
    SIGKILL from the kernel (deploy.parent_guard) instead of serving on with nobody watching them."""
    up = TandemUp(up_args(tiny_checkpoint, tmp_path, "--prefill", "1", "--decode", "1"))
    try:
        up.wait_ready()
        os.kill(up.pids["decode-0"], signal.SIGKILL)
        up.wait_for(r"^decode-0 restarted as pid (\d+)", 30)  # forked after start, by the supervision
        # the fork server reports the pid as it forks; the child takes its own command line a moment later
        deadline = time.monotonic() + 10
        while (up.pids["decode-0"] not in (children := cluster_processes(up.proc.pid))
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert up.pids["decode-0"] in children and len(children) == 3
        up.proc.kill()
        up.proc.wait(10)
        deadline = time.monotonic() + 10
        while any(is_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in children if is_alive(pid)], "processes outlived their launcher"
    finally:
        up.cleanup()


def test_crashing_past_the_limit_exits_nonzero_with_the_reason(tiny_checkpoint, tmp_path):
    up = TandemUp(up_args(tiny_checkpoint, tmp_path, "--colocated", "1", "--max-restarts", "1"))
    try:
        url = up.wait_ready()
        os.kill(up.pids["colocated-0"], signal.SIGKILL)
        new_pid = int(up.wait_for(r"^colocated-0 restarted as pid (\d+)", 30).group(1))
        wait_for_incarnation(url, "colocated-0", new_pid, timeout_s=30)
        os.kill(new_pid, signal.SIGKILL)
        assert up.exit_code(timeout_s=60) == 1, up.output
        assert ("colocated-0 was killed by signal SIGKILL; not restarted: 2 crashes in a row (max_restarts=1)"
                in up.output)
        assert "tandem up: error: the cluster cannot serve: no decode or colocated worker is left" in up.output
        assert not [pid for pid in up.all_pids if is_alive(pid)]  # the router was stopped too
    finally:
        up.cleanup()


def read_a_long_stream(url: str, tiny_checkpoint, max_tokens: int = 1900) -> tuple[dict, threading.Thread]:
    """Start a ``max_tokens`` stream and read it in a thread; returns once it is streaming. The dict
    gets ``finish`` and ``ended`` when it completes, ``error`` when it breaks."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    stream = client.completions.create(model=Path(tiny_checkpoint("llama")).name, prompt="a long story",
                                       max_tokens=max_tokens, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    result: dict = {}

    def consume():
        num_chunks, finish = 0, None
        try:
            for chunk in stream:
                num_chunks += 1
                finish = chunk.choices[0].finish_reason or finish
                if num_chunks == 5:
                    result["streaming"] = time.monotonic()
        except (openai.APIError, httpx.HTTPError) as exc:
            result["error"] = repr(exc)
        else:
            result.update(finish=finish, ended=time.monotonic())

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    while "streaming" not in result:
        assert reader.is_alive(), result
        time.sleep(0.05)
    return result, reader


def test_sigterm_lets_a_running_stream_finish(tiny_checkpoint, tmp_path):
    up = TandemUp(up_args(tiny_checkpoint, tmp_path, "--prefill", "1", "--decode", "1"))
    try:
        # long enough to be under way at the signal (seconds of steps), short enough not to spend them all
        result, reader = read_a_long_stream(up.wait_ready(), tiny_checkpoint, max_tokens=700)
        children = cluster_processes(up.proc.pid)
        up.proc.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        assert up.exit_code(timeout_s=60) == 0, up.output
        reader.join(timeout=10)
        assert result.get("finish") == "length", (result, up.output)
        assert result["ended"] > signalled_at
        assert not [pid for pid in children if is_alive(pid)]
    finally:
        up.cleanup()


def test_a_second_sigterm_stops_at_once_without_waiting_for_the_drain(tiny_checkpoint, tmp_path):
    up = TandemUp(up_args(tiny_checkpoint, tmp_path, "--colocated", "1", "--drain-timeout-s", "120"))
    try:
        # A request is in flight: the first signal drains, and would wait for it.
        result, reader = read_a_long_stream(up.wait_ready(), tiny_checkpoint)
        children = cluster_processes(up.proc.pid)
        up.proc.send_signal(signal.SIGTERM)
        up.wait_for("shutting down")
        up.proc.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        up.wait_for("stopping at once")
        assert up.exit_code(timeout_s=30) == 0, up.output
        assert time.monotonic() - signalled_at < 15  # not the 120 s drain
        reader.join(timeout=10)
        assert result.get("finish") != "length", result  # cut off, not drained
        assert not [pid for pid in children if is_alive(pid)]
    finally:
        up.cleanup()
