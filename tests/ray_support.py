"""A real single-node Ray head for tests, on loopback only, stopped by pid.

``ray start --head --block`` runs in its own session with a private ``--temp-dir``, a small object
store (/dev/shm stays free for KV caches) and a free port for every listener Ray opens. Ray binds
the machine's external address unless told otherwise; ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (what
keeps a laptop's local Ray on 127.0.0.1) with ``--node-ip-address=127.0.0.1`` puts every Ray socket
on loopback. Anything that talks to this head must run with ``env`` (the same variables).

Stopping never uses ``ray stop`` (it stops every Ray process on the machine): SIGTERM to the
``ray start --block`` process (it drains and stops its children), then SIGKILL by pid to any process
whose command line still names this head's temp dir.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY_BIN = Path(sys.executable).with_name("ray")


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (held open together, so none repeats)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def processes_mentioning(text: str) -> list[int]:
    """Pids of this machine's processes whose command line contains ``text``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry))
    return pids


class RayHead:
    """``with RayHead() as head:`` -> ``head.address`` ("127.0.0.1:PORT") and ``head.env`` for clients."""

    def __init__(self, num_cpus: int = 2, object_store_bytes: int = 100_000_000) -> None:
        self.num_cpus = num_cpus
        self.object_store_bytes = object_store_bytes
        # short: Ray puts Unix sockets under it, and a socket path must fit in 107 bytes
        self.temp_dir = tempfile.mkdtemp(prefix="tray-", dir="/tmp")
        (gcs, client, agent_http, agent_grpc, runtime_env, node_manager, object_manager, metrics,
         autoscaler_metrics, dashboard_metrics) = free_ports(10)
        self.port = gcs
        self.address = f"127.0.0.1:{gcs}"
        self.env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
                    "AUTOSCALER_METRIC_PORT": str(autoscaler_metrics), "DASHBOARD_METRIC_PORT": str(dashboard_metrics),
                    "RAY_ADDRESS": self.address}
        self._args = [
            str(RAY_BIN), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
            f"--temp-dir={self.temp_dir}", f"--object-store-memory={object_store_bytes}", f"--num-cpus={num_cpus}",
            "--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats",
            f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
            f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={runtime_env}",
            f"--node-manager-port={node_manager}", f"--object-manager-port={object_manager}",
            f"--metrics-export-port={metrics}",
        ]
        self.log_path = Path(self.temp_dir) / "ray-start.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 90.0) -> "RayHead":
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self._args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}:\n{self.log_tail()}")
            if b"Ray runtime started" in self.log_path.read_bytes():
                return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the Ray head did not start within {timeout_s:g} s:\n{self.log_tail()}")

    def log_tail(self, num_lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def run(self, *args: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess:
        """Run a command against this head (with ``env``): e.g. ``head.run("tandem", "ray", "status")``."""
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout_s)

    def leftover_pids(self) -> list[int]:
        return processes_mentioning(self.temp_dir)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # ray start --block drains, then stops its children
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        deadline = time.monotonic() + 10.0
        while self.leftover_pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in self.leftover_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "RayHead":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def tandem_ray_deployment(head: "RayHead", tandem: str, log_dir, *up_args: str, log_level: str = "INFO"):
    """``tandem --log-level <log_level> ray up <up_args>`` on ``head`` with free HTTP and ZMQ ports and ``log_dir``:
    yields ``{"url", "log_dir", "up" (the completed process), "pids"}``, then ``tandem ray down`` (idempotent) and
    no Tandem process left that mentions ``log_dir`` (any found is killed, and the test fails)."""
    http_port, zmq_port = free_ports(2)
    result = head.run(tandem, "--log-level", log_level, "ray", "up", *up_args, "--port", str(http_port),
                      "--zmq-port", str(zmq_port), "--log-dir", str(log_dir), timeout_s=300)
    info = {"url": f"http://127.0.0.1:{http_port}", "log_dir": str(log_dir), "up": result, "pids": set()}
    try:
        yield info
    finally:
        head.run(tandem, "ray", "down", timeout_s=120)
        leftovers = processes_mentioning(str(log_dir))
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        assert not leftovers, f"Tandem processes outlived tandem ray down: {leftovers}"
