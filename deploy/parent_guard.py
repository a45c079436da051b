"""A supervised process dies with its supervisor: Linux's parent-death signal.

``tandem ray up``'s supervisor actors and ``tandem up``'s launcher (``deploy.local_launcher``) start
each Tandem process with ``TANDEM_DIE_WITH_PARENT`` set to their own pid. The process then asks the kernel (``prctl(PR_SET_PDEATHSIG)``) for SIGKILL the
moment its parent goes, however it goes (``ray.kill``, a crash, the OOM killer), so a worker never
outlives the actor that supervises it and never holds a port or a GPU nobody is watching.

The request is made by the child itself, first thing in ``tandem``'s ``main``: asking for it between
``fork`` and ``exec`` (``preexec_fn``) is unsafe in a process with threads, and a Ray actor has many.
The kernel ties the signal to the parent *thread* that forked, so the actor forks from the one thread
that lives as long as it does, and the launcher from one thread that ends only after its processes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import Mapping

logger = logging.getLogger(__name__)

DIE_WITH_PARENT_ENV = "TANDEM_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1


def die_with_parent_if_asked(environ: Mapping[str, str] = os.environ) -> None:
    """If ``TANDEM_DIE_WITH_PARENT`` names our parent's pid, get SIGKILL when it exits; if that
    parent is already gone (it died before we asked), exit now."""
    raw = environ.get(DIE_WITH_PARENT_ENV)
    if not raw:
        return
    if not raw.isdigit():
        raise ValueError(f"{DIE_WITH_PARENT_ENV}: must be the supervisor's pid (got {raw!r})")
    if not sys.platform.startswith("linux"):
        logger.warning("%s is only honoured on Linux; this process may outlive its supervisor", DIE_WITH_PARENT_ENV)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != int(raw):
        os._exit(1)  # the supervisor died between our fork and the prctl: nobody would watch us
