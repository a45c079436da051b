"""A process's sign of life for its launcher's watchdog (``deploy.watchdog``), as systemd's ``WatchdogSec``.

A launcher that watches its processes sets ``TANDEM_WATCHDOG_DIR`` in their environment; each process then
touches ``<dir>/<its pid>`` about once a second from the thread whose silence means it is frozen: a worker from
its router link's thread (the one that heartbeats, which no engine step blocks), the router from its event loop.
A process stopped (SIGSTOP, a debugger), one whose GIL is held for good, or a router whose event loop is wedged
stops touching it, and the launcher kills and restarts it. Nothing is written when the variable is unset (a
worker started by hand). The file exists only from the first beat, so start-up (a checkpoint loading) is never
taken for a freeze.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

WATCHDOG_DIR_ENV = "TANDEM_WATCHDOG_DIR"
BEAT_INTERVAL_S = 1.0


class SignOfLife:
    """``beat()`` as often as you like from the thread that must stay alive; it touches the file at most once
    per ``BEAT_INTERVAL_S``. Construct it in the process it speaks for (the path names the current pid)."""

    def __init__(self, directory: str | None = None) -> None:
        directory = directory if directory is not None else os.environ.get(WATCHDOG_DIR_ENV)
        self.path = Path(directory) / str(os.getpid()) if directory else None
        self._last_beat = float("-inf")
        self._has_warned = False

    def beat(self, now: float | None = None) -> None:
        if self.path is None:
            return
        now = time.monotonic() if now is None else now
        if now - self._last_beat < BEAT_INTERVAL_S:
            return
        self._last_beat = now
        try:
            self.path.touch()
        except OSError as exc:  # the launcher's dir is gone (it is stopping): nothing to tell anyone
            if not self._has_warned:
                logger.warning("cannot touch the watchdog file %s (%s); the launcher may take this process for "
                               "frozen", self.path, exc.strerror)
                self._has_warned = True

    async def beat_from_event_loop(self) -> None:
        """Beat until cancelled, as a task of the event loop whose wedging means the process is frozen."""
        while True:
            self.beat()
            await asyncio.sleep(BEAT_INTERVAL_S / 2)
