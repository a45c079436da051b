"""Where a worker's process runs: the CPU cores it may use and how many torch threads it starts.

Cores use Linux list syntax (``pipeline/core_list.py``). A worker
applies its placement first thing, before torch loads its OpenMP runtime (which reads
``OMP_NUM_THREADS`` once) and before the tokenizer's and ZMQ's threads start (a new thread inherits
its creator's affinity; threads already running are bound one by one).
"""

from __future__ import annotations

import os

from pipeline.core_list import format_core_list, parse_core_list

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


def apply_cpu_placement(config) -> tuple[list[int], int]:
    """Bind this process to ``config.cpu_cores`` (if set), then set torch's intra-op thread count
    (``config.num_threads``, else one per core): ``config`` is a ``PipelineConfig``. With
    ``tensor_parallel_size`` > 1 this process is rank 0 and takes rank 0's share (``rank_placement``).

    Returns (the cores this process may use, its torch threads). Call before anything starts threads
    and before the first torch import: binding imports no torch, and ``OMP_NUM_THREADS`` is read when
    torch loads its OpenMP runtime.
    """
    allowed_cores(config.cpu_cores)  # every core named is ours, before any is split among ranks
    cores, num_threads = rank_placement(config, 0)
    if cores is not None:
        bind_to_cores(cores)
    cores = cores or allowed_cores(None)
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    import torch

    torch.set_num_threads(num_threads)
    return cores, torch.get_num_threads()


def rank_cores(cores: list[int], num_ranks: int) -> list[list[int]]:
    """Each tensor-parallel rank's share of a worker's cores: contiguous runs as even as possible (the first
    ranks get the extra cores), or one core each, round-robin, when there are fewer cores than ranks."""
    if num_ranks >= len(cores):
        return [[cores[rank % len(cores)]] for rank in range(num_ranks)]
    shares, start = [], 0
    for rank in range(num_ranks):
        size = len(cores) // num_ranks + (rank < len(cores) % num_ranks)
        shares.append(cores[start:start + size])
        start += size
    return shares


def rank_placement(config, rank: int) -> tuple[list[int] | None, int]:
    """Tensor-parallel rank ``rank``'s cores (None when ``config.cpu_cores`` is unset: it stays where it was
    started) and torch threads (``config.num_threads``, else one per core of its share). With
    ``tensor_parallel_size`` 1 that is the whole worker's placement."""
    named = parse_core_list(config.cpu_cores) if config.cpu_cores is not None else None
    share = rank_cores(named or sorted(os.sched_getaffinity(0)), config.tensor_parallel_size)[rank]
    return (share if named is not None else None), config.num_threads or len(share)


def describe_placement(cores: list[int], num_threads: int) -> str:
    """"cores 0-1, 2 torch threads"."""
    return f"cores {format_core_list(cores)}, {num_threads} torch thread{'s' if num_threads != 1 else ''}"
