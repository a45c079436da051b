"""The ``tandem`` CLI as a user runs it: ``tandem up`` and one process per role over a TCP base."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster.conftest import free_port
from tests.deploy.conftest import TANDEM, cluster_processes, is_alive


def wait_ready(url: str, procs: list[subprocess.Popen], num_workers: int, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            assert proc.poll() is None, f"process exited early: {proc.args}"
        try:
            body = httpx.get(f"{url}/ready", timeout=2).json()
            if body["ready"] and sum(w["alive"] for w in body["workers"]) == num_workers:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    raise AssertionError("not ready in time")


def test_tandem_up_serves_and_stops_every_process_on_sigterm(tiny_checkpoint, tmp_path):
    """... and leaves nothing on disk but its logs: no socket file under its ipc:// base, no work dir (config
    file, cluster key). A flag beats a TANDEM_* variable in every process (the processes inherited the variable
    and applied it again, over the flag); --decode alone keeps --prefill's default (1P1D)."""
    port = free_port()
    ipc_dir = Path(tempfile.mkdtemp(prefix="up-"))  # short: a Unix socket's path has ~107 bytes
    launcher = subprocess.Popen(
        [*TANDEM, "up", "--decode", "1", "--model", tiny_checkpoint("llama"), "--port", str(port),
         "--log-dir", str(tmp_path / "logs"), "--kv-cache-num-blocks", "128", "--max-length", "96",
         "--zmq-endpoint-base", f"ipc://{ipc_dir}/c"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "TANDEM_MAX_LENGTH": "80"},
    )
    children: list[int] = []
    try:
        lines = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = launcher.stdout.readline()
            assert line, f"tandem up exited early:\n{''.join(lines)}"
            lines.append(line)
            if "ready at" in line:
                break
        assert f"http://127.0.0.1:{port}/v1" in lines[-1]
        name = Path(tiny_checkpoint("llama")).name  # the banner names what clients send as model, not the path
        assert f"(model: {name!r}, from {tiny_checkpoint('llama')})" in lines[-1]
        children = cluster_processes(launcher.pid)
        assert len(children) == 3  # router, prefill, decode
        arguments = Path(f"/proc/{children[0]}/cmdline").read_bytes().decode().split("\0")
        work_dir = Path(next(a for a in arguments if a.endswith("cluster.yaml"))).parent
        assert list(ipc_dir.iterdir())  # the sockets, while it runs
        out = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                         json={"model": name, "prompt": "Hi", "max_tokens": 4},
                         timeout=60)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] >= 1
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["max_model_len"] == 96
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 0
        assert not [pid for pid in children if is_alive(pid)]
        assert list(ipc_dir.iterdir()) == [] and not work_dir.exists()
        assert list((tmp_path / "logs").glob("*.log"))
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        for pid in children:
            if is_alive(pid):
                os.killpg(pid, signal.SIGKILL)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def test_one_process_per_role_over_tcp(tiny_checkpoint, tmp_path):
    """Each worker binds its own sockets on its own address (127.0.0.2 and 127.0.0.3 stand for two
    other hosts' addresses) and peers reach it there; by default, the address on the route to the router."""
    base = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    subprocess.run([*TANDEM, "keygen", "--out", str(tmp_path / "key")], check=True, capture_output=True, timeout=60)
    common = ["--model", tiny_checkpoint("llama"), "--zmq-endpoint-base", base, "--kv-cache-num-blocks", "128",
              "--cluster-key-file", str(tmp_path / "key" / "cluster.key_secret")]  # tcp:// needs the cluster key
    commands = [
        ["router", "--port", str(port), *common],
        ["prefill", "--worker-id", "p0", "--bind-host", "127.0.0.2", *common],
        ["decode", "--worker-id", "d0", "--transfer-transport", "zmq", "--bind-host", "127.0.0.3", *common],
    ]
    procs = [subprocess.Popen([*TANDEM, *c], stdout=open(tmp_path / f"{c[0]}.log", "w"), stderr=subprocess.STDOUT,
                              start_new_session=True) for c in commands]
    try:
        wait_ready(f"http://127.0.0.1:{port}", procs, num_workers=2)
        out = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                         json={"model": Path(tiny_checkpoint("llama")).name, "prompt": "Hi", "max_tokens": 5,
                               "ignore_eos": True}, timeout=60)
        assert out.status_code == 200, out.text
        assert out.json()["usage"]["completion_tokens"] == 5
        assert "listening on tcp://127.0.0.2:" in (tmp_path / "prefill.log").read_text()
        assert "listening on tcp://127.0.0.3:" in (tmp_path / "decode.log").read_text()
        # a worker of another model (the built-in one) is refused by name, in one line (it was a traceback)
        stranger = subprocess.run([*TANDEM, "decode", "--worker-id", "d9", *common[2:]],
                                  capture_output=True, text=True, timeout=120)
        assert stranger.returncode == 2, stranger.stderr
        assert "tandem decode: error: the router refused worker d9: model" in stranger.stderr
        assert "Traceback" not in stranger.stderr
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize(
    "args, message",
    [
        (["decode", "--max-batch-size", "-1"], "max_batch_size: Input should be greater than or equal to 1"),
        (["prefill", "--zmq-endpoint-base", "http://nope"], "zmq_endpoint_base"),
        (["decode", "--bind-host", "0.0.0.0"], "bind_host: must be an address peers can connect to"),
        (["worker", "--role", "PrefillOnly", "--config", "/nonexistent.yaml"], "config_file: no such file"),
        (["up", "--kv-cache-page-size", "0"], "kv_cache.page_size"),
        (["up", "--model", "/nonexistent/dir"], "checkpoint directory /nonexistent/dir does not exist"),
        (["up", "--max-restarts", "-1"], "--max-restarts: must be >= 0 (got -1)"),
        (["up", "--watchdog-timeout", "-1"], "--watchdog-timeout: must be >= 0 (got -1)"),
    ],
)
def test_bad_config_is_a_clear_error(args, message):
    result = subprocess.run([*TANDEM, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_the_triton_backend_on_a_cpu_worker_is_refused_at_start():
    """Compiled triton kernels need CUDA: a CPU worker told to use them would fail every request, so it does not start
    (under TRITON_INTERPRET=1 the interpreter runs them, as the kernel tests do)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([*TANDEM, "generate", "--kernel-backend", "triton", "--max-tokens", "2", "hi"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stderr
    assert "kernel_backend: 'triton' runs compiled kernels on a CUDA device, and this device is cpu" in result.stderr
    assert "Traceback" not in result.stderr


def test_worker_processes_let_idle_openmp_threads_sleep(monkeypatch):
    """Workers share cores: spinning OpenMP threads of one worker stall every other (docs/load.md)."""
    from deploy.serve_cmds import quiet_openmp_waits

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    quiet_openmp_waits()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # a user's explicit choice stands
    quiet_openmp_waits()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_an_unsupported_checkpoint_is_refused_before_anything_starts(tmp_path):
    """A real architecture Tandem has no model class for (GPT-2) is named in the error, and no router or
    worker is started for it (no log of theirs)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    checkpoint = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(checkpoint)
    log_dir = tmp_path / "logs"
    result = subprocess.run([*TANDEM, "up", "--model", str(checkpoint), "--log-dir", str(log_dir)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "unsupported architecture GPT2LMHeadModel; supported: LlamaForCausalLM" in result.stderr
    assert "Traceback" not in result.stderr and not list(log_dir.glob("*.log"))
