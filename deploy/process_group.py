"""Stopping processes that lead their own process group (started with ``start_new_session``, or forked by
the fork server, which calls ``setsid``): what both launchers (``tandem up``, the Ray supervisors) use."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time

logger = logging.getLogger(__name__)


def terminate_groups(processes: dict[str, subprocess.Popen], timeout_s: float, is_forced: threading.Event) -> None:
    """SIGTERM every process group, wait up to ``timeout_s`` in all (less once ``is_forced`` is set),
    SIGKILL what is still running."""
    for proc in processes.values():
        signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not is_forced.is_set():
        if all(proc.poll() is not None for proc in processes.values()):
            return
        time.sleep(0.05)
    for name, proc in processes.items():
        if proc.poll() is None:
            if not is_forced.is_set():
                logger.warning("%s did not stop in %.0fs; killing it", name, timeout_s)
            signal_group(proc, signal.SIGKILL)
            proc.wait(5)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal ``proc``'s process group (it was started with ``start_new_session``), unless it has exited."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)  # the child leads its own group (start_new_session)
    except ProcessLookupError:
        pass
