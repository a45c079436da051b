"""The launcher's side of the watchdog (``pipeline.sign_of_life``): which of its processes has frozen.

The router declares a silent worker dead after ``dead_after_s`` and routes around it, but a frozen process
(SIGSTOP, a debugger left attached, a GIL held for good, a wedged event loop) does not exit, so a launcher that
only restarts processes that exit would leave it frozen, holding its memory and cores, for ever. A process
whose sign of life is older than ``timeout_s`` is frozen: the launcher kills its process group (a
tensor-parallel worker's ranks with it) and its restart policy starts it again, counted as a crash.

A process that has not beaten yet (still starting) is never called frozen; its start-up has its own deadlines.
Nor is any process right after the launcher itself did not run for a while (the host suspended or paused, the
launcher starved or stopped): every process stood still with it, so silence counts again from that moment, as
the router's late liveness check declares nobody dead.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

from kv_transfer.process_identity import process_state
from pipeline.sign_of_life import WATCHDOG_DIR_ENV

__all__ = ["Watchdog", "WATCHDOG_DIR_ENV"]

LAUNCHER_GAP_S = 2.0  # the launcher looks every fraction of a second: a longer gap means it did not run itself


class Watchdog:
    """Reads the signs of life that processes started with ``env()`` leave in ``directory``."""

    def __init__(self, directory: Path, timeout_s: float) -> None:
        """``timeout_s`` <= 0 turns the watchdog off (``env()`` is empty, nothing is ever frozen)."""
        self.directory = Path(directory)
        self.timeout_s = timeout_s
        self._last_look: float | None = None  # wall time of the last why_frozen
        self._counting_from = float("-inf")  # silence before this (the launcher itself stood still) does not count
        if self.is_on:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)

    @property
    def is_on(self) -> bool:
        return self.timeout_s > 0

    def env(self) -> dict[str, str]:
        """What a watched process's environment needs."""
        return {WATCHDOG_DIR_ENV: str(self.directory)} if self.is_on else {}

    def why_frozen(self, pid: int) -> str | None:
        """Why the running process ``pid`` counts as frozen, or None (alive, still starting, or watchdog off)."""
        if not self.is_on:
            return None
        now = time.time()
        if self._last_look is not None and now - self._last_look > LAUNCHER_GAP_S:
            self._counting_from = now
        self._last_look = now
        try:
            silent_s = now - max((self.directory / str(pid)).stat().st_mtime, self._counting_from)
        except FileNotFoundError:
            return None
        if silent_s <= self.timeout_s:
            return None
        state = " (it is stopped: SIGSTOP or a debugger)" if process_state(pid) in ("T", "t") else ""
        return f"gave no sign of life for {silent_s:.0f} s{state} (watchdog_timeout_s={self.timeout_s:g})"

    def forget(self, pid: int) -> None:
        """``pid`` has exited: its file goes (a later process that reuses the pid starts unarmed)."""
        (self.directory / str(pid)).unlink(missing_ok=True)

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            shutil.rmtree(self.directory)
