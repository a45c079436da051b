"""A tensor-parallel worker's ranks on a Ray cluster: one placement group per worker, and the cores it holds
(pure: no Ray import; ``deploy.ray_cluster.placement_groups`` makes the groups).

A worker with ``tensor_parallel_size`` N is N processes on one host: rank 0, the process its supervisor
actor starts, starts ranks 1..N-1 on the same host (``pipeline.parallel.ranks``). So the worker reserves
what its ranks use as one placement group of **one bundle** (``STRICT_PACK``) holding N CPUs (and N x
``--gpus-per-worker`` GPUs, its role's custom resources), and its supervisor actor runs in that bundle and
holds all of it. One bundle rather than N bundles of one CPU: a bundle never spans nodes, an actor sits in
one bundle, and the ranks are not Ray actors, so N bundles would only be N pieces of the same reservation.

Ray counts CPUs, it does not pin them. The reservation becomes cores on the node once every actor is
placed (``reserve_cores``): each worker that holds a group gets that many of its node's cores to itself,
which it splits among its ranks as under ``tandem up`` (``pipeline.cpu_placement.rank_cores``); the workers
without a group split what is left, prefill apart from decode, as before.
"""

from __future__ import annotations

STRATEGY = "STRICT_PACK"
_ROLE_FLAGS = {"prefill": "--prefill-tensor-parallel-size / --tensor-parallel-size",
               "decode": "--decode-tensor-parallel-size / --tensor-parallel-size"}


def rank_flag(name: str) -> str:
    """The flag(s) a worker's rank count comes from, for errors."""
    return _ROLE_FLAGS.get(name.split("-")[0], "--tensor-parallel-size")


def worker_bundle(name: str, resources: dict[str, float], num_ranks: int) -> dict[str, float]:
    """The one bundle of worker ``name`` of ``num_ranks`` ranks: its resources (``spec.worker_resources``, GPUs
    already counted for every rank) with at least one CPU per rank. ``ValueError`` naming the flag when its
    GPUs cannot give each rank one of its own (rank r runs on ``cuda:r``)."""
    bundle = {name: amount for name, amount in resources.items() if amount}
    bundle["CPU"] = max(float(num_ranks), float(resources.get("CPU", 0.0)))
    gpus = bundle.get("GPU", 0.0)
    if gpus and (gpus < num_ranks or gpus != int(gpus)):
        raise ValueError(f"{rank_flag(name)} {num_ranks}: each rank needs a whole GPU of its own, and {name} gets "
                         f"{gpus:g} (--gpus-per-worker is per rank; a role's \"GPU\" in --prefill-resources / "
                         "--decode-resources is the whole worker's)")
    return bundle


def check_fits(bundles: dict[str, dict[str, float]], node_totals: list[dict[str, float]]) -> None:
    """``ValueError`` naming the flag when no live node (``node_totals``: each node's total resources) could
    ever hold a worker's bundle: all of a worker's ranks run on one node, so that node needs every CPU."""
    for name, bundle in bundles.items():
        if any(all(total.get(key, 0.0) >= amount for key, amount in bundle.items()) for total in node_totals):
            continue
        largest = max((total.get("CPU", 0.0) for total in node_totals), default=0.0)
        raise ValueError(f"{rank_flag(name)}: {name} runs its ranks on one node and reserves them as one placement "
                         f"group {_describe(bundle)}, which no node of the cluster can hold (the largest has "
                         f"{largest:g} CPUs); use fewer ranks, or nodes with more CPUs")


def reserve_cores(pool: list[int], held: dict[str, int]) -> tuple[dict[str, list[int]], list[int]]:
    """({worker name: its own cores}, the cores left) for the workers of one node that hold a placement group
    (``held``: {name: CPUs held}): prefill workers' runs from the start of ``pool``, the others' from its end,
    so the rest of the pool stays one run between them. ``ValueError`` when the pool has fewer cores than the
    groups hold (the node's Ray counts more CPUs than its cores, or ``cpu_cores`` leaves too few)."""
    if sum(held.values()) > len(pool):
        raise ValueError(f"the placement groups of {', '.join(sorted(held))} hold {sum(held.values())} CPUs on "
                         f"one node whose pool has {len(pool)} cores")
    plan: dict[str, list[int]] = {}
    start, end = 0, len(pool)
    for name in sorted(held, key=lambda n: (not n.startswith("prefill-"), n)):
        if name.startswith("prefill-"):
            plan[name], start = pool[start:start + held[name]], start + held[name]
        else:
            plan[name], end = pool[end - held[name]:end], end - held[name]
    return plan, pool[start:end]


def _describe(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{key}: {amount:g}" for key, amount in sorted(bundle.items())) + "}"
