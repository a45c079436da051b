"""How a CPU worker's C heap treats the memory a step frees: kept for the next step, not handed back.

glibc's malloc serves each allocation above its mmap threshold with a fresh ``mmap`` and unmaps it on free,
and trims the heap's free top back to the kernel past twice that threshold. The threshold starts at 128 KiB
and rises to the size of each mapped block freed, so where it settles depends on the order of a process's
first allocations. A CPU step allocates and frees its activations every layer; below a settled threshold, each
step faults its pages back in, zeroed by the kernel: ~100,000 page faults and ~5 % of the time of a 512x8
bf16 offline run on a Zen 5 core; 250,000-350,000 faults a run of the 1.1B shape in some processes, none in
others (docs/cpu-kernels.md). vLLM's CPU build preloads tcmalloc into its processes for the same
reason. Here glibc is told (``mallopt``) to settle at once where it would at best: blocks up to 32 MiB (its
largest threshold) from the heap, and the heap's free top kept up to 1 GiB. The peak resident memory is
unchanged (the same tensors are live at the peak), but the process stays near its peak rather than giving
memory back between steps. Larger blocks are still mapped one by one: served from the heap, glibc's aligned
allocations of one size each leave a hole too small for the next, and the heap grew to 8 times such a block
before reusing one. Not glibc (musl, another OS): nothing is changed.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on a 64-bit system (DEFAULT_MMAP_THRESHOLD_MAX)
_MMAP_THRESHOLD_BYTES = 32 << 20
# free memory at the heap's top kept before trimming: more than any step frees at once
_TRIM_THRESHOLD_BYTES = 1 << 30

_applied = False


def keep_freed_memory() -> bool:
    """Have glibc serve blocks up to 32 MiB from its heap and keep freed memory (trim only past 1 GiB free at
    the top). Idempotent; returns whether it is in effect in this process."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
            return False
        # mallopt returns 1 on success (setting either one stops glibc adjusting both)
        _applied = (bool(libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES))
                    and bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)))
    except OSError as exc:  # no C library to load symbols from
        log.debug("keep_freed_memory: %s", exc)
        return False
    return _applied
