"""The ``ipc://`` socket files this process bound, removed when it exits.

libzmq leaves an ipc listener's file behind when the socket closes, so a process run by hand (``tandem
prefill``, ``tandem router``) would leave one file per bound socket in its ipc directory every time it
stops, and a worker's names carry its pid, so restarts pile them up. Each file is removed at exit
(``atexit``; a worker forked by ``deploy/zygote.py``, which leaves with ``os._exit``, removes its own there) if it
is still the file this process bound: a successor that bound the same path since (once this process stopped
listening) replaced it with a file of its own, which stays.
"""

from __future__ import annotations

import atexit
import os
import threading

_bound: dict[str, tuple[int, int, int]] = {}  # path -> (device, inode, ctime ns) of the file this process's bind made
_lock = threading.Lock()


def remember_bound_file(path: str) -> None:
    """Record the socket file a bind just created (removed at exit)."""
    try:
        identity = _identity(path)
    except FileNotFoundError:
        return
    with _lock:
        if not _bound:
            atexit.register(remove_bound_files)
        _bound[path] = identity


def remove_bound_files() -> None:
    """Remove every file recorded here that is still the one this process bound; best effort."""
    with _lock:
        bound = dict(_bound)
        _bound.clear()
    for path, identity in bound.items():
        try:
            if _identity(path) == identity:
                os.unlink(path)
        except OSError:  # gone already, or not ours to remove
            pass


def _identity(path: str) -> tuple[int, int, int]:
    """What tells one file at ``path`` from a later one (an inode number alone is reused at once on tmpfs)."""
    info = os.stat(path)
    return info.st_dev, info.st_ino, info.st_ctime_ns
