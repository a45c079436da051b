"""The launcher's side of the fork server (``deploy.zygote``): ``ForkServer`` starts a zygote and asks
it for processes; ``ForkedProcess`` is the ``subprocess.Popen``-like handle of one (``pid``, ``poll``,
``wait``, ``send_signal``, ``kill``), so ``LocalCluster`` supervises forked and exec'd processes alike.

A forked process is the zygote's child, not ours: its exit code reaches us as an ``Exited`` report,
read whenever a handle is polled. If the zygote itself dies, its children die with it (parent-death
signal) and every handle reads as killed; ``shared_fork_server()`` starts a new zygote on the next call.

One zygote serves every cluster of a launcher process (``shared_fork_server``): the imports are paid
once per process, which is what makes a test session's clusters and a launcher's restarts cheap.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from deploy.zygote import Exited, Ready, Spawn, Spawned, SpawnFailed, decode_from_zygote, encode

logger = logging.getLogger(__name__)

ZYGOTE_ENV = "TANDEM_ZYGOTE"  # "0": every process is exec'd afresh (no fork server)
READY_TIMEOUT_S = 300.0  # the zygote's imports, on a busy machine


class ForkServerError(RuntimeError):
    """The zygote could not be started or has gone."""


class ForkedProcess:
    """A process the zygote forked: what ``LocalCluster`` uses of ``subprocess.Popen``."""

    def __init__(self, server: "ForkServer", pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._server.collect_exits()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([f"pid {self.pid}"], timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One zygote process and the conversation with it. Thread-safe."""

    def __init__(self, log_path: str | os.PathLike, env: dict[str, str] | None = None) -> None:
        ours, theirs = socket.socketpair()
        env = {**(env if env is not None else os.environ), "PYTHONUNBUFFERED": "1"}
        env.pop("TANDEM_DIE_WITH_PARENT", None)  # the zygote watches its socket instead (deploy.zygote.main)
        with open(log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "deploy.zygote", str(theirs.fileno())], pass_fds=[theirs.fileno()],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._buffer = b""
        self._children: dict[int, ForkedProcess] = {}
        self._replies: dict[int, ForkedProcess | SpawnFailed] = {}  # request id -> its child, or why not
        self._next_request_id = 0
        self._is_ready = False
        self.is_alive = True

    @property
    def pid(self) -> int:
        return self._proc.pid

    def spawn(self, module: str, args: list[str], env: dict[str, str], log_path: str | os.PathLike,
              cwd: str | None = None) -> ForkedProcess:
        """Fork ``python -m module args`` with exactly ``env``, appending its output to ``log_path``."""
        with self._lock:
            self._await_ready()
            request_id = self._next_request_id
            self._next_request_id += 1
            request = Spawn(request_id=request_id, module=module, args=list(args), env=dict(env),
                            cwd=cwd or os.getcwd(), log_path=str(log_path))
            try:
                self._sock.sendall(encode(request) + b"\n")
            except OSError as exc:
                self._on_gone()
                raise ForkServerError(f"the fork server is gone: {exc}") from None
            while request_id not in self._replies:
                self._read(blocking=True)
            reply = self._replies.pop(request_id)
            if isinstance(reply, SpawnFailed):
                raise ForkServerError(f"fork failed: {reply.error}")
            return reply  # its exit may already be recorded: a child that died at once

    def collect_exits(self) -> None:
        """Read whatever the zygote has reported, without waiting."""
        if not self._lock.acquire(blocking=False):
            return  # another thread is reading; its reports land in the same handles
        try:
            self._read(blocking=False)
        finally:
            self._lock.release()

    def close(self) -> None:
        """Stop the zygote (its remaining children get SIGKILL) and wait for it."""
        with self._lock:
            try:
                self._sock.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)
        self._on_gone()

    def _await_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._is_ready:
            if time.monotonic() > deadline:
                raise ForkServerError(f"the fork server did not start within {READY_TIMEOUT_S:.0f}s")
            self._read(blocking=True, timeout_s=1.0)

    def _read(self, blocking: bool, timeout_s: float | None = None) -> None:
        """Read and apply reports; ``blocking``: wait for at least one chunk (or ``timeout_s``)."""
        if not self.is_alive:
            raise ForkServerError("the fork server is gone")
        self._sock.settimeout(timeout_s if blocking else 0.0)
        try:
            data = self._sock.recv(1 << 16)
        except (BlockingIOError, socket.timeout, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._on_gone()
            raise ForkServerError(f"the fork server (pid {self._proc.pid}) exited")
        self._buffer += data
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            self._apply(decode_from_zygote(line))

    def _apply(self, report) -> None:
        if isinstance(report, Ready):
            self._is_ready = True
        elif isinstance(report, Spawned):
            child = self._children[report.pid] = ForkedProcess(self, report.pid)
            self._replies[report.request_id] = child
        elif isinstance(report, SpawnFailed):
            self._replies[report.request_id] = report
        elif isinstance(report, Exited):
            child = self._children.pop(report.pid, None)
            if child is not None:
                child.returncode = report.returncode

    def _on_gone(self) -> None:
        """The zygote exited: its children were killed with it (parent-death signal)."""
        self.is_alive = False
        for child in self._children.values():
            if child.returncode is None:
                child.returncode = -signal.SIGKILL
        self._children.clear()


_shared: ForkServer | None = None
_shared_lock = threading.Lock()


def fork_server_enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get(ZYGOTE_ENV, "1").lower() not in ("0", "false", "off", "no")


def shared_fork_server(log_path: str | os.PathLike) -> ForkServer:
    """This process's zygote, started (logging to ``log_path``) if there is none or it has gone."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.is_alive:
            _shared = ForkServer(log_path)
            logger.info("fork server started as pid %d (log: %s)", _shared.pid, log_path)
        return _shared
