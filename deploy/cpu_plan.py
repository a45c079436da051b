"""Which cores each worker of a local cluster gets: prefill and decode apart, so neither stalls the other.

A prefill step is one long burst of compute; a decode worker's steps are short and latency-bound. On
shared cores a burst delays every decode step (and each stream's next token), so by default the two
groups get disjoint cores, in proportion to their worker counts. Pure functions; ``tandem up`` runs them.
"""

from __future__ import annotations

from deploy.local_launcher import worker_names
from pipeline.core_list import format_core_list


def plan_cores(available: list[int], num_prefill: int, num_decode: int, num_colocated: int,
               share: bool = False) -> dict[str, list[int]]:
    """{worker name (as LocalCluster names them): its cores}, taken from ``available``.

    The prefill workers and the decode + colocated workers split the cores in proportion to their
    counts (at least one core each; a tie goes to prefill, whose long steps use threads best), each
    group into contiguous runs per worker, round-robin single cores when a group has more workers
    than cores. ``share`` (or a single core) gives every worker every core.
    """
    pool = sorted(set(available))
    if not pool:
        raise ValueError("no CPU cores to plan with")
    prefill = worker_names(num_prefill, 0, 0)
    decoding = worker_names(0, num_decode, num_colocated)
    if share or len(pool) == 1:
        return {name: list(pool) for name in prefill + decoding}
    if not prefill or not decoding:
        return _split(pool, prefill + decoding)
    num_prefill_cores = int(len(pool) * len(prefill) / (len(prefill) + len(decoding)) + 0.5)
    num_prefill_cores = min(max(num_prefill_cores, 1), len(pool) - 1)
    return {**_split(pool[:num_prefill_cores], prefill), **_split(pool[num_prefill_cores:], decoding)}


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


def _split(cores: list[int], names: list[str]) -> dict[str, list[int]]:
    """Contiguous runs as even as possible (the first workers get the extra cores); one core each,
    round-robin, when there are more workers than cores."""
    if len(names) >= len(cores):
        return {name: [cores[i % len(cores)]] for i, name in enumerate(names)}
    plan, start = {}, 0
    for i, name in enumerate(names):
        size = len(cores) // len(names) + (i < len(cores) % len(names))
        plan[name] = cores[start:start + size]
        start += size
    return plan


def describe_plan(plan: dict[str, list[int]], num_threads: int | None = None) -> str:
    """"prefill-0: cores 0 (1 thread) | decode-0: cores 1 (1 thread)", plus a warning when prefill and
    decode workers share a core. ``num_threads``: the configured thread count (None: one per core)."""
    parts = []
    for name, cores in plan.items():
        threads = num_threads or len(cores)
        parts.append(f"{name}: cores {format_core_list(cores)} ({threads} thread{'s' if threads != 1 else ''})")
    text = " | ".join(parts)
    shared = _cores_of(plan, is_prefill=True) & _cores_of(plan, is_prefill=False)
    if shared:
        text += (f" (warning: prefill and decode workers share core{'s' if len(shared) > 1 else ''} "
                 f"{format_core_list(shared)}; a prefill step delays decode steps there)")
    return text
