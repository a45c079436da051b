"""LocalCluster: the router and N prefill / M decode / K colocated workers as processes on this host.

Each process runs in its own process group (so a Ctrl-C in the terminal reaches the launcher, which
then shuts every child down in order) and logs to a file of its own. All sockets derive from one
``zmq_endpoint_base`` (a fresh ``ipc://`` path by default, so clusters never collide).
``tests/`` uses the same class as its cluster fixture.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

logger = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """A process of the cluster failed to start or become ready; the message holds its log tail."""


@dataclass
class LocalCluster:
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0
    model_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    config: dict = field(default_factory=dict)  # PipelineConfig overrides shared by every process
    api_key: str | None = None
    router_options: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._workdir = Path(tempfile.mkdtemp(prefix="tandem-"))
        self.log_dir = Path(self.log_dir) if self.log_dir else self._workdir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.config = dict(self.config)
        self.config.setdefault("zmq_endpoint_base", f"ipc://{self._workdir}/zmq")
        if self.model_path is not None:
            self.config.setdefault("model", {})["model_path"] = str(self.model_path)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def worker_names(self) -> list[str]:
        return ([f"prefill-{i}" for i in range(self.num_prefill)] + [f"decode-{i}" for i in range(self.num_decode)]
                + [f"colocated-{i}" for i in range(self.num_colocated)])

    # --------------------------------------------------------------- control
    def start(self, timeout_s: float = 180.0) -> "LocalCluster":
        if self.num_decode + self.num_colocated == 0:
            raise ClusterError("a cluster needs at least one decode or colocated worker")
        if self.num_decode and not self.num_prefill:
            logger.warning("decode workers without prefill workers prefill locally (colocated fallback)")
        if self.config.get("model", {}).get("model_path") is None:
            from pipeline.builtin_model import builtin_model_path  # build once here, not in every child

            builtin_model_path()
        config_path = self._workdir / "cluster.yaml"
        config_path.write_text(yaml.safe_dump({"cluster": self.config}))
        common = ["--config", str(config_path), "--section", "cluster"]
        router_args = ["router", "--host", self.host, "--port", str(self.port), *self.router_options]
        if self.api_key:
            router_args += ["--api-key", self.api_key]
        try:
            self._spawn("router", router_args + common)
            roles = {"prefill": "PrefillOnly", "decode": "DecodeOnly", "colocated": "PrefillAndDecode"}
            for name in self.worker_names:
                role = roles[name.split("-")[0]]
                self._spawn(name, ["worker", "--role", role, "--worker-id", name, *common])
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.log_dir / f"{name}.log", "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "--log-level", "INFO", *args],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )
        log.close()

    def wait_ready(self, timeout_s: float) -> None:
        """Until the router reports ready with every worker alive; fails fast if a process exits."""
        deadline = time.monotonic() + timeout_s
        expected = set(self.worker_names)
        while time.monotonic() < deadline:
            for name, proc in self.processes.items():
                if proc.poll() is not None:
                    raise ClusterError(f"{name} exited with code {proc.returncode}:\n{self.log_tail(name)}")
            try:
                body = httpx.get(f"{self.url}/ready", timeout=2.0).json()
                alive = {w["worker_id"] for w in body.get("workers", []) if w.get("alive")}
                if body.get("ready") and expected <= alive:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise ClusterError(f"cluster not ready after {timeout_s:.0f}s; logs in {self.log_dir}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal one process of this cluster (fault tests)."""
        self.processes[name].send_signal(sig)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every process group (workers first, router last), then SIGKILL stragglers."""
        order = [n for n in self.processes if n != "router"] + [n for n in self.processes if n == "router"]
        for name in order:
            _signal_group(self.processes[name], signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name in order:
            proc = self.processes[name]
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %.0fs; killing it", name, timeout_s)
                _signal_group(proc, signal.SIGKILL)
                proc.wait(5)
        self.processes.clear()
        for leftover in self._workdir.glob("zmq-*"):  # ipc socket files; logs stay for the user
            leftover.unlink(missing_ok=True)
        from kv_transfer.shm import remove_stale_shared_kv_caches

        remove_stale_shared_kv_caches()  # shared KV caches of workers that had to be killed

    def log_tail(self, name: str, num_lines: int = 40) -> str:
        path = self.log_dir / f"{name}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return "\n".join(lines[-num_lines:])

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)  # the child leads its own group (start_new_session)
    except ProcessLookupError:
        pass
