"""``ProcessSpawner``: how ``LocalCluster`` starts a process — a worker forked from the fork server
(``deploy.zygote``), the router exec'd by the one thread that forks (``deploy.local_launcher``'s docstring
says why only that thread does) — each with its own log (a fresh one, appended to on a restart), in its
own session, told to die with the launcher (``deploy.parent_guard``); a restart runs the same command."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deploy.parent_guard import DIE_WITH_PARENT_ENV
from deploy.zygote_client import ForkedProcess, shared_fork_server

# the log level of the processes a launcher starts: the launcher's own --log-level when given (deploy/cli.py sets
# it), else INFO (their log files are where an operator looks)
CHILD_LOG_LEVEL_ENV = "TANDEM_CHILD_LOG_LEVEL"


class ProcessSpawner:
    def __init__(self, log_dir: Path, entry_module: str, env: dict[str, str], use_fork_server: bool) -> None:
        self.log_dir = log_dir
        self.entry_module = entry_module  # what ``python -m`` runs in each process
        self.env = env  # set in every process's environment, over ours
        self.use_fork_server = use_fork_server
        self._commands: dict[str, tuple[list[str], dict[str, str]]] = {}  # name -> its last arguments, own env
        self._spawner: ThreadPoolExecutor | None = None  # the one thread that forks

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start_fork_server(self) -> None:
        """Start the fork server now, so its imports overlap the router's start."""
        shared_fork_server(self.log_dir / "zygote.log")

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen | ForkedProcess:
        """Start ``name`` (first start: a fresh log; a restart: the same command, appended to its log); ``env``:
        its own variables, over every process's (a secret for this one process, kept out of its command line,
        which any local user can read).

        Workers are forked by the fork server (``deploy.zygote``: torch and transformers imported once
        per launcher, not once per process); the router, which never loads torch, is exec'd afresh."""
        is_restart = name in self._commands
        self._commands[name] = (args, env or {})
        log_path = self.log_path(name)
        with open(log_path, "ab" if is_restart else "wb") as log:
            if is_restart:
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                log.write(f"\n===== {stamp} tandem: {name} restarted; the previous run's output is above =====\n"
                          .encode())
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env, **(env or {}), DIE_WITH_PARENT_ENV: str(os.getpid())}
        argv = ["--log-level", os.environ.get(CHILD_LOG_LEVEL_ENV, "INFO"), *args]
        if name != "router" and self.use_fork_server:
            return shared_fork_server(self.log_dir / "zygote.log").spawn(self.entry_module, argv, env, log_path)
        if self._spawner is None:
            self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-spawner")
        with open(log_path, "ab") as log:
            return self._spawner.submit(
                subprocess.Popen, [sys.executable, "-m", self.entry_module, *argv],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
            ).result()

    def respawn(self, name: str) -> subprocess.Popen | ForkedProcess:
        """Start ``name`` again with the command it was last started with."""
        return self.spawn(name, *self._commands[name])

    def close(self) -> None:
        """Let the forking thread go; only once every process it started has ended (the kernel ties
        their die-with-parent signal to it). A later ``spawn`` starts a new one."""
        spawner, self._spawner = self._spawner, None
        if spawner is not None:
            spawner.shutdown(wait=True)
