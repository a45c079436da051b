"""The ``ipc://`` socket files this process bound, removed when it exits.

libzmq leaves an ipc listener's file behind when the socket closes, so a process run by hand (``tandem
prefill``, ``tandem router``) would leave one file per bound socket in its ipc directory every time it
stops, and a worker's names carry its pid, so restarts pile them up. Each file is removed at exit
(``atexit``; a worker forked by ``deploy/zygote.py``, which leaves with ``os._exit``, removes its own there) if it
is still the file this process bound: a successor that bound the same path since (a restarted router)
replaced it with a file of its own, which stays.
"""

from __future__ import annotations

import atexit
import os
import threading

_bound: dict[str, int] = {}  # path -> the inode this process's bind created
_lock = threading.Lock()


def remember_bound_file(path: str) -> None:
    """Record the socket file a bind just created (removed at exit)."""
    try:
        inode = os.stat(path).st_ino
    except FileNotFoundError:
        return
    with _lock:
        if not _bound:
            atexit.register(remove_bound_files)
        _bound[path] = inode


def remove_bound_files() -> None:
    """Remove every file recorded here that is still the one this process bound; best effort."""
    with _lock:
        bound = dict(_bound)
        _bound.clear()
    for path, inode in bound.items():
        try:
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        except OSError:  # gone already, or not ours to remove
            pass
