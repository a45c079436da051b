"""Whether another process on this host has exited, told apart from a later process that reuses its pid.

An in-place KV writer (shm, cuda_ipc) shares the receiver's host: when it is SIGKILLed, the receiver need not
wait out the revocation timeout for an acknowledgement that cannot come, since a process that has exited (or is a
zombie, its memory already released) writes nothing more. A pid alone is not proof (pids are reused, and a
process in another pid namespace has other numbers), so the identity is the pid namespace, the pid and the
process's start time (``/proc/<pid>/stat`` field 22).
"""

from __future__ import annotations

import os

_NO_IDENTITY = ""


def own_identity() -> str:
    """This process's identity (``"<pid namespace inode>:<pid>:<start time>"``), or "" where /proc cannot say."""
    try:
        return f"{os.stat('/proc/self/ns/pid').st_ino}:{os.getpid()}:{_stat_fields('self')[19]}"
    except (OSError, ValueError, IndexError):
        return _NO_IDENTITY


def has_exited(identity: str) -> bool:
    """True only when the process ``identity`` names has certainly exited: it shares this process's pid
    namespace and its pid is gone, a zombie, or another process's. False when it runs, or when this cannot tell
    (no identity, another pid namespace, no /proc)."""
    try:
        namespace, pid, start_time = identity.split(":")
        if int(namespace) != os.stat("/proc/self/ns/pid").st_ino:
            return False
    except (OSError, ValueError):
        return False
    try:
        fields = _stat_fields(str(int(pid)))
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        return False
    return fields[0] in ("Z", "X") or fields[19] != start_time


def process_state(pid: int) -> str | None:
    """``pid``'s state letter (``R``, ``S``, ``T`` stopped, ``t`` traced, ``Z`` zombie, ...), None where it is gone
    or /proc cannot say."""
    try:
        return _stat_fields(str(int(pid)))[0]
    except (OSError, ValueError, IndexError):
        return None


def _stat_fields(pid: str) -> list[str]:
    """``/proc/<pid>/stat`` after the command's closing parenthesis: field 3 (state) is [0], field 22 (start
    time) [19]."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()
