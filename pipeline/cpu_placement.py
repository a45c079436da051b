"""Where a worker's process runs: the CPU cores it may use and how many torch threads it starts.

Cores use Linux list syntax ("0-3,6", as ``taskset -c`` and vLLM's CPU backend take them). A worker
applies its placement first thing, before torch loads its OpenMP runtime (which reads
``OMP_NUM_THREADS`` once) and before the tokenizer's and ZMQ's threads start (a new thread inherits
its creator's affinity; threads already running are bound one by one).
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig

_MAX_CORE = 65535  # far above any Linux NR_CPUS; bounds the list "0-99999999" would expand to
_ITEM = re.compile(r"(\d+)(?:-(\d+))?")


def parse_core_list(text: str) -> list[int]:
    """"0-3,6" -> [0, 1, 2, 3, 6] (sorted, unique); ValueError saying what is wrong with ``text``."""
    if not text.strip():
        raise ValueError("empty core list (Linux list syntax: '0-3,6'; unset = every core)")
    cores: set[int] = set()
    for raw_item in text.split(","):
        item = raw_item.strip()
        if not item:
            raise ValueError("empty item in the core list (Linux list syntax: '0-3,6')")
        if re.fullmatch(r"-\d+(-\d+)?", item):
            raise ValueError(f"{item!r}: core numbers are >= 0")
        match = _ITEM.fullmatch(item)
        if match is None:
            raise ValueError(f"{item!r} is not a core number or range (Linux list syntax: '0-3,6')")
        first = int(match.group(1))
        last = first if match.group(2) is None else int(match.group(2))
        if last < first:
            raise ValueError(f"descending range {item!r}; write '{last}-{first}'")
        if last > _MAX_CORE:
            raise ValueError(f"core {last} is out of range (at most {_MAX_CORE})")
        cores.update(range(first, last + 1))
    return sorted(cores)


def format_core_list(cores: list[int] | set[int]) -> str:
    """[0, 1, 2, 3, 6] -> "0-3,6": consecutive cores as ranges."""
    runs: list[list[int]] = []
    for core in sorted(set(cores)):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def allowed_cores(cpu_cores: str | None) -> list[int]:
    """The cores ``cpu_cores`` names, each checked to be one this process may run on (None: all of those)."""
    available = sorted(os.sched_getaffinity(0))
    if cpu_cores is None:
        return available
    cores = parse_core_list(cpu_cores)
    missing = sorted(set(cores) - set(available))
    if missing:
        raise ValueError(f"cpu_cores: core {format_core_list(missing)} not available to this process "
                         f"(available: {format_core_list(available)})")
    return cores


def bind_to_cores(cores: list[int]) -> None:
    """Restrict every thread of this process, and every thread created later, to ``cores``.

    ``sched_setaffinity(0)`` binds the calling thread only, so each existing thread is bound by its id.
    """
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except ProcessLookupError:  # that thread ended meanwhile
            pass


def apply_cpu_placement(config: PipelineConfig) -> tuple[list[int], int]:
    """Bind this process to ``config.cpu_cores`` (if set), then set torch's intra-op thread count.

    Returns (the cores this process may use, its torch threads). Call before anything starts threads
    and before the first torch import: binding imports no torch, and ``OMP_NUM_THREADS`` is read when
    torch loads its OpenMP runtime.
    """
    cores = allowed_cores(config.cpu_cores)
    if config.cpu_cores is not None:
        bind_to_cores(cores)
    num_threads = config.num_threads or len(cores)
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    import torch

    torch.set_num_threads(num_threads)
    return cores, torch.get_num_threads()


def describe_placement(cores: list[int], num_threads: int) -> str:
    """"cores 0-1, 2 torch threads"."""
    return f"cores {format_core_list(cores)}, {num_threads} torch thread{'s' if num_threads != 1 else ''}"
