"""The Ray side of a tensor-parallel worker's placement group (``deploy.ray_cluster.rank_groups`` says why one
group of one bundle): made before the worker's supervisor actor, which is scheduled into it, and removed with it.

A group is detached and named like its worker's actor (``tandem:colocated-0``, namespace ``tandem``), so it
outlives ``tandem ray up``'s driver, a restarted actor lands in it again (Ray restarts an actor in the bundle
it was scheduled into; on a node that died, Ray reschedules the group first), and ``tandem ray down`` finds
it by name, including a group whose actor is already gone.
"""

from __future__ import annotations

import time

from deploy.ray_cluster import spec as specs
from deploy.ray_cluster.rank_groups import STRATEGY, check_fits, worker_bundle

REMOVE_WAIT_S = 30.0


def bundles(names: list[str], num_ranks: dict[str, int], gpus: float, prefill_resources: dict[str, float],
            decode_resources: dict[str, float]) -> dict[str, dict[str, float]]:
    """{worker name: its group's bundle} for the workers of several ranks (``num_ranks``; ``gpus`` per rank);
    ``ValueError`` naming the flag when a bundle is malformed or no live node could ever hold it."""
    import ray

    found = {}
    for name in names:
        if name != specs.ROUTER and num_ranks.get(name, 1) > 1:
            resources = specs.worker_resources(name, gpus * num_ranks[name], prefill_resources, decode_resources)
            found[name] = worker_bundle(name, resources, num_ranks[name])
    if found:
        check_fits(found, [node["Resources"] for node in ray.nodes() if node.get("Alive")])
    return found


def create(actor_name: str, bundle: dict[str, float]):
    """A detached one-bundle group named ``actor_name``; Ray reserves it as soon as a node can hold it."""
    import ray

    return ray.util.placement_group([bundle], strategy=STRATEGY, name=actor_name, lifetime="detached")


def actor_options(group, bundle: dict[str, float]) -> dict:
    """Actor options that run the supervisor in ``group``'s bundle and hold all of it (its CPUs, GPUs and
    custom resources), so nothing else Ray schedules can be given them."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options = specs.actor_options(bundle)
    options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=0, placement_group_capture_child_tasks=False)
    return options


def table(deployment: str | None = None) -> dict[str, dict]:
    """{group name: Ray's table entry} of the live groups Tandem named (one deployment's, or all)."""
    import ray

    found = {}
    for entry in ray.util.placement_group_table().values():
        parts = specs.split_actor_name(entry.get("name") or "")
        if entry["state"] != "REMOVED" and parts is not None and deployment in (None, parts[0]):
            found[entry["name"]] = entry
    return found


def remove(names: set[str] | list[str]) -> list[str]:
    """Remove the live groups among ``names`` (in this namespace) and wait until Ray has; returns those removed."""
    import ray

    live = set(table()) & set(names)
    for name in live:
        try:
            ray.util.remove_placement_group(ray.util.get_placement_group(name))
        except ValueError:  # gone meanwhile
            pass
    deadline = time.monotonic() + REMOVE_WAIT_S
    while live & set(table()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return sorted(live)


def describe(entry: dict) -> dict:
    """What ``tandem ray status`` shows of a group: name, state, strategy, its bundle and node."""
    return {"name": entry["name"], "state": entry["state"], "strategy": entry["strategy"],
            "bundle": entry["bundles"].get(0, {}), "node_id": entry["bundles_to_node_id"].get(0)}
