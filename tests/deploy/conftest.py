"""Helpers for running ``tandem`` as a user does: a subprocess whose printed lines the test reads."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

TANDEM = [sys.executable, "-m", "deploy.cli"]


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def descendants_of(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        children = [child for parent in frontier for child in children_of(parent)]
        found += children
        frontier = children
    return found


def cluster_processes(launcher_pid: int) -> list[int]:
    """The Tandem processes a launcher runs: its descendants that run ``deploy.cli`` (the router, exec'd,
    and the workers, forked by the fork server under their own command line), not the fork server."""
    return [pid for pid in descendants_of(launcher_pid) if b"deploy.cli" in _cmdline(pid)]


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class TandemUp:
    """``tandem up ARGS`` in its own session; stdout and stderr are read line by line in a thread."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen([*TANDEM, "up", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self._new_lines: queue.Queue[str | None] = queue.Queue()
        self.pids: dict[str, int] = {}  # every process pid tandem up printed, newest incarnation last
        self.all_pids: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._new_lines.put(line)
        self._new_lines.put(None)

    def wait_for(self, pattern: str, timeout_s: float = 60) -> re.Match:
        """The first line from now on that matches ``pattern`` (a regex); fails on timeout or exit."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._new_lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in {timeout_s:.0f}s:\n{self.output}") from None
            if line is None:
                self._new_lines.put(None)
                raise AssertionError(f"tandem up exited before printing {pattern!r}:\n{self.output}")
            self.lines.append(line)
            self._note_pids(line)
            match = re.search(pattern, line)
            if match:
                return match

    def _note_pids(self, line: str) -> None:
        if line.startswith("pids: "):
            for item in line[len("pids: "):].split(", "):
                name, pid = item.split()
                self.pids[name] = int(pid)
        match = re.search(r"^(\S+) restarted as pid (\d+)", line)
        if match:
            self.pids[match.group(1)] = int(match.group(2))
        self.all_pids.update(self.pids.values())

    def wait_ready(self, timeout_s: float = 240) -> str:
        """Until the ready line and the pids line; returns the cluster's URL."""
        url = self.wait_for(r"ready at (http://\S+)/v1", timeout_s).group(1)
        self.wait_for(r"^pids: ", 10)
        return url

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def exit_code(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout=timeout_s)
        while (line := self._new_lines.get(timeout=5)) is not None:  # the rest of the output, for messages
            self.lines.append(line)
        self._new_lines.put(None)
        return code

    def cleanup(self) -> None:
        """Kill whatever is left (a failed test): the launcher's group and each child's."""
        pids = self.all_pids | set(descendants_of(self.proc.pid))
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid in pids:
            if is_alive(pid) and (b"deploy.cli" in _cmdline(pid) or b"deploy.zygote" in _cmdline(pid)):  # ours
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
