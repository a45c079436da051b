"""A peer's OpenAI-compatible server as a child process, for the serving benchmarks: started pinned to
the benchmark's cores, ready once ``/health`` answers and a greedy warm-up request came back, stopped
with SIGTERM (SIGKILL after a grace period) of its whole process group. ``bench/peer_transformers.py``
and ``bench/peer_vllm.py`` say which command and environment."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx

ENDPOINT = "/v1/completions"
POLL_INTERVAL_S = 0.2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PeerServer:
    """Subclasses set ``name``, ``command`` and ``model_name`` and may extend ``environment``.

    The server's output goes to ``log_path`` (a temporary file, removed on stop, when not given). Use as a
    context manager, or call :meth:`start` and :meth:`stop`.
    """

    name = "peer"
    endpoint = ENDPOINT

    def __init__(self, *, port: int | None = None, log_path: Path | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.command: list[str] = []
        self.model_name = ""
        self._process: subprocess.Popen | None = None
        self._scratch: Path | None = None
        self._log: Path | None = None

    def environment(self, scratch: Path) -> dict[str, str]:
        """The server's environment; ``scratch`` is a private temporary directory, removed on stop."""
        return dict(os.environ)

    def start(self, timeout_s: float = 600.0) -> None:
        """Start the server and return once it has answered a greedy warm-up request."""
        self._scratch = Path(tempfile.mkdtemp(prefix=f"peer-{self.name}-"))
        env = self.environment(self._scratch)
        self._log = self.log_path or self._scratch / "serve.log"
        with open(self._log, "ab") as log:
            self._process = subprocess.Popen(self.command, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_until_ready(time.monotonic() + timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_until_ready(self, deadline: float) -> None:
        with httpx.Client(base_url=self.url, timeout=10.0) as client:
            while not self._answers_health(client):
                exited = self._process.poll() is not None
                if exited or time.monotonic() > deadline:
                    what = f"exited with {self._process.returncode}" if exited else "did not answer /health in time"
                    raise RuntimeError(f"{self.name} {what}; its log ends:\n"
                                       f"{self._log.read_text(errors='replace')[-3000:]}")
                time.sleep(POLL_INTERVAL_S)
            body = {"model": self.model_name, "prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
            response = client.post(self.endpoint, json=body, timeout=max(1.0, deadline - time.monotonic()))
            response.raise_for_status()

    @staticmethod
    def _answers_health(client: httpx.Client) -> bool:
        try:
            return client.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``timeout_s``; idempotent."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it may exit between the poll and the signal
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
