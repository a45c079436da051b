"""Which cores each worker of a local cluster gets: prefill and decode apart, so neither stalls the other.

A prefill step is one long burst of compute; a decode worker's steps are short and latency-bound. On
shared cores a burst delays every decode step (and each stream's next token), so by default the two
groups get disjoint cores, in proportion to their worker counts. Pure functions; ``tandem up`` runs them.
"""

from __future__ import annotations

from deploy.local_launcher import worker_names
from pipeline.core_list import format_core_list
from pipeline.cpu_placement import rank_cores


def plan_cores(available: list[int], num_prefill: int, num_decode: int, num_colocated: int,
               share: bool = False, num_ranks: dict[str, int] | None = None) -> dict[str, list[int]]:
    """{worker name (as LocalCluster names them): its cores}, taken from ``available``.

    The prefill workers and the decode + colocated workers split the cores in proportion to their
    counts (at least one core each; a tie goes to prefill, whose long steps use threads best), each
    group into contiguous runs per worker, round-robin single cores when a group has more workers
    than cores. ``share`` (or a single core) gives every worker every core. ``num_ranks`` ({worker name:
    tensor_parallel_size}, 1 for those absent) counts a worker of N ranks as N workers, so each rank gets
    a run of its own: the worker splits its cores among its ranks the same way (``cpu_placement.rank_cores``).
    """
    pool = sorted(set(available))
    if not pool:
        raise ValueError("no CPU cores to plan with")
    num_ranks = num_ranks or {}
    prefill = _rank_slots(worker_names(num_prefill, 0, 0), num_ranks)
    decoding = _rank_slots(worker_names(0, num_decode, num_colocated), num_ranks)
    if share or len(pool) == 1:
        return {name: list(pool) for name in dict.fromkeys(prefill + decoding)}
    if not prefill or not decoding:
        return _merge_slots(_split(pool, prefill + decoding))
    num_prefill_cores = int(len(pool) * len(prefill) / (len(prefill) + len(decoding)) + 0.5)
    num_prefill_cores = min(max(num_prefill_cores, 1), len(pool) - 1)
    return _merge_slots(_split(pool[:num_prefill_cores], prefill) + _split(pool[num_prefill_cores:], decoding))


def _rank_slots(names: list[str], num_ranks: dict[str, int]) -> list[str]:
    """Each worker's name once per rank, in order: ["colocated-0", "colocated-0", "colocated-1"]."""
    return [name for name in names for _ in range(num_ranks.get(name, 1))]


def _merge_slots(slots: list[tuple[str, list[int]]]) -> dict[str, list[int]]:
    """A worker's cores: those of its ranks' slots, in slot order, each once."""
    plan: dict[str, list[int]] = {}
    for name, cores in slots:
        plan.setdefault(name, [])
        plan[name] += [core for core in cores if core not in plan[name]]
    return plan


def router_cores(plan: dict[str, list[int]]) -> list[int]:
    """Where the router runs: beside the prefill workers when they have cores of their own, else on
    every planned core. The router parses requests and streams every token out; keeping it off the
    decode cores leaves those to decode steps, whose latency every stream sees, while a prefill step
    only shifts first tokens a little."""
    everything = sorted({c for cores in plan.values() for c in cores})
    prefill = sorted(_cores_of(plan, is_prefill=True))
    return prefill if prefill and len(prefill) < len(everything) else everything


def _cores_of(plan: dict[str, list[int]], is_prefill: bool) -> set[int]:
    """The cores of the plan's prefill workers (or of every other worker)."""
    return {c for name, cores in plan.items() if name.startswith("prefill-") == is_prefill for c in cores}


def _split(cores: list[int], slots: list[str]) -> list[tuple[str, list[int]]]:
    """(slot, cores) pairs: contiguous runs as even as possible (the first slots get the extra cores); one
    core each, round-robin, when there are more slots than cores."""
    if len(slots) >= len(cores):
        return [(name, [cores[i % len(cores)]]) for i, name in enumerate(slots)]
    runs, start = [], 0
    for i, name in enumerate(slots):
        size = len(cores) // len(slots) + (i < len(cores) % len(slots))
        runs.append((name, cores[start:start + size]))
        start += size
    return runs


def describe_plan(plan: dict[str, list[int]], num_threads: int | None = None,
                  num_ranks: dict[str, int] | None = None) -> str:
    """"prefill-0: cores 0 (1 thread) | decode-0: cores 1 (1 thread)", plus a warning when prefill and
    decode workers share a core. ``num_threads``: the configured thread count (None: one per core);
    a worker of several ranks (``num_ranks``) lists each rank's cores: "colocated-0: cores 0-1 (rank 0: 0, 1
    thread; rank 1: 1, 1 thread)"."""
    parts = []
    for name, cores in plan.items():
        shares = rank_cores(cores, (num_ranks or {}).get(name, 1))
        described = [f"{format_core_list(share) if len(shares) > 1 else ''}{', ' if len(shares) > 1 else ''}"
                     f"{_threads(num_threads or len(share))}" for share in shares]
        if len(shares) > 1:
            described = [f"rank {rank}: {text}" for rank, text in enumerate(described)]
        parts.append(f"{name}: cores {format_core_list(cores)} ({'; '.join(described)})")
    text = " | ".join(parts)
    shared = _cores_of(plan, is_prefill=True) & _cores_of(plan, is_prefill=False)
    if shared:
        text += (f" (warning: prefill and decode workers share core{'s' if len(shared) > 1 else ''} "
                 f"{format_core_list(shared)}; a prefill step delays decode steps there)")
    return text


def _threads(num: int) -> str:
    return f"{num} thread{'s' if num != 1 else ''}"
