"""The names of shared-memory KV caches in /dev/shm and their removal: torch-free, so a launcher can
reclaim a dead worker's cache without loading torch.

A cache is the file ``/dev/shm/tandem-kv.<pid>.<name>`` of the process ``pid`` that allocated it. A
process that exits normally removes its own (``kv_transfer.shm``); one killed by a signal cannot, so
its supervisor removes them by pid once it has seen the exit (``remove_shared_kv_files_of``), and a
worker starting on the host removes those of any pid that no longer runs
(``remove_stale_shared_kv_files``).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "tandem-kv."


def shared_kv_file_path(pid: int, name: str) -> str:
    return os.path.join(SHM_DIR, f"{PREFIX}{pid}.{name}")


def shared_kv_files_of(pids: set[int] | None = None) -> list[str]:
    """Paths of the shared KV caches on this host allocated by one of ``pids`` (None: by anyone)."""
    paths = []
    for entry in os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []:
        pid = _owner_pid(entry)
        if pid is not None and (pids is None or pid in pids):
            paths.append(os.path.join(SHM_DIR, entry))
    return sorted(paths)


def remove_shared_kv_files_of(pids: set[int]) -> list[str]:
    """Remove the caches of processes ``pids``, which the caller knows have exited; returns the paths."""
    removed = shared_kv_files_of(pids)
    for path in removed:
        unlink_quietly(path)
    return removed


def remove_stale_shared_kv_files() -> list[str]:
    """Remove the caches of every process that no longer runs; returns the paths."""
    removed = []
    for path in shared_kv_files_of():
        pid = _owner_pid(os.path.basename(path))
        if pid is not None and not is_running(pid):
            unlink_quietly(path)
            removed.append(path)
    return removed


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove shared KV cache %s: %s", path, exc)


def _owner_pid(entry: str) -> int | None:
    if not entry.startswith(PREFIX):
        return None
    pid_text = entry[len(PREFIX):].split(".", 1)[0]
    return int(pid_text) if pid_text.isdigit() else None


def is_running(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
