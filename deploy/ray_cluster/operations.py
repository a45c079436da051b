"""What ``tandem ray`` does to a deployment that runs: status, rolling restart, scale-down and down, on the
detached supervisor actors ``deploy.ray_cluster.deployment.up`` created, found by name (any machine that reaches
the cluster), and the stop-and-kill that ``up`` also uses to leave nothing behind when it fails."""

from __future__ import annotations

import time
from typing import Callable

from deploy.ray_cluster import placement_groups
from deploy.ray_cluster import spec as specs
from deploy.ray_cluster.spec import ROUTER

STATUS_TIMEOUT_S = 10.0


class DeployError(RuntimeError):
    """``tandem ray`` could not do what was asked; the message says why and what to look at."""


def deployment_actors(deployment: str | None = None) -> dict[str, tuple[str, str]]:
    """{actor name: (deployment, process)} of Tandem's actors (one deployment's, or all)."""
    import ray

    found = {}
    for name in ray.util.list_named_actors(all_namespaces=False):
        parts = specs.split_actor_name(name)
        if parts is not None and (deployment is None or parts[0] == deployment):
            found[name] = parts
    return found


def status(deployment: str | None = None) -> list[dict]:
    """One row per process: its actor's ``status()`` plus ``ready`` (router: /ready; workers: alive
    in the router's view); an actor that does not answer shows as "unreachable"."""
    import ray

    rows = []
    found = deployment_actors(deployment)
    for actor_name in sorted(found, key=lambda n: (found[n][0], found[n][1] != ROUTER, found[n][1])):
        dep, process = found[actor_name]
        try:
            row = ray.get(ray.get_actor(actor_name).status.remote(), timeout=STATUS_TIMEOUT_S)
        except (ray.exceptions.RayError, ValueError) as exc:
            row = {"deployment": dep, "name": process, "state": "unreachable", "last_event": str(exc).splitlines()[0]}
        rows.append(row)
    for dep in {row["deployment"] for row in rows}:
        _add_readiness([row for row in rows if row["deployment"] == dep])
    groups = placement_groups.table(deployment)
    for row in rows:
        entry = groups.get(specs.actor_name(row["deployment"], row["name"]))
        if entry is not None:
            row["placement_group"] = placement_groups.describe(entry)
    return rows


def _add_readiness(rows: list[dict]) -> None:
    import ray

    router = next((row for row in rows if row["name"] == ROUTER and row["state"] == "running"), None)
    body = {}
    if router is not None:
        try:
            body = ray.get(ray.get_actor(specs.actor_name(router["deployment"], ROUTER)).router_ready.remote(),
                           timeout=STATUS_TIMEOUT_S)
        except ray.exceptions.RayError:
            body = {}
    alive = {w["worker_id"] for w in body.get("workers", []) if w.get("alive")}
    for row in rows:
        row["ready"] = bool(body.get("ready")) if row["name"] == ROUTER else row["name"] in alive


def rolling_restart(deployment: str | None = None, say: Callable[[str], None] = print,
                    timeout_s: float = 300.0) -> list[str]:
    """Replace every worker of a deployment one at a time, prefill workers first, with no failed request:
    each gets SIGTERM and drains (the router routes around it; a decode worker hands its streams off with
    their KV), its supervisor actor starts it again at once (a planned exit, no backoff), and the next one
    goes only when the router has the new process alive. The new processes read the deployment's config
    again from the actor, and the checkpoint from disk. Returns the processes replaced."""
    import ray

    dep, found = _one_deployment(deployment)
    router = ray.get_actor(specs.actor_name(dep, ROUTER))
    workers = sorted((process for _, process in found.values() if process != ROUTER),
                     key=lambda process: (not process.startswith("prefill-"), process))
    for process in workers:
        actor = ray.get_actor(specs.actor_name(dep, process))
        old_pid = ray.get(actor.replace.remote(), timeout=STATUS_TIMEOUT_S)
        if old_pid is None:
            raise DeployError(f"{process} runs no process now (see `tandem ray status`); nothing was replaced "
                              "from here on")
        say(f"replacing {process} (pid {old_pid}): draining")
        pid = _wait_replaced(actor, router, process, old_pid, timeout_s)
        say(f"  {process} is back as pid {pid}")
    return workers


def _one_deployment(deployment: str | None) -> tuple[str, dict[str, tuple[str, str]]]:
    """The deployment a command acts on (the named one, or the only one running) and its actors."""
    found = deployment_actors(deployment)
    deployments = {dep for dep, _ in found.values()}
    if not deployments:
        raise DeployError(f"no Tandem deployment {deployment!r} is running" if deployment
                          else "no Tandem deployment is running")
    if len(deployments) > 1:
        raise DeployError(f"several deployments run ({', '.join(sorted(deployments))}): name one with --name")
    return deployments.pop(), found


def scale_down(deployment: str | None, processes: list[str], say: Callable[[str], None] = print) -> list[str]:
    """Remove workers from a running deployment, one at a time, with no failed request: each gets SIGTERM
    and drains (the router routes around it; a decode worker hands its streams to the others with their
    KV), then its supervisor actor is removed, so nothing restarts it. The router and at least one decode
    or colocated worker stay. Returns the processes removed."""
    import ray

    dep, found = _one_deployment(deployment)
    running = {process for _, process in found.values()}
    unknown = sorted(set(processes) - running)
    if unknown:
        raise DeployError(f"deployment {dep!r} has no {', '.join(unknown)} (it runs {', '.join(sorted(running))})")
    if ROUTER in processes:
        raise DeployError("the router is not a worker to remove: `tandem ray down` stops the whole deployment")
    left = running - set(processes)
    if not any(process.startswith(("decode-", "colocated-")) for process in left):
        raise DeployError("that would leave no decode or colocated worker to serve; keep one")
    for process in processes:
        actor_name = specs.actor_name(dep, process)
        say(f"removing {process}: draining")
        stop_and_kill({actor_name: ray.get_actor(actor_name)}, wait_s=None)
        say(f"  {process} is gone")
    return processes


def _wait_replaced(actor, router, process: str, old_pid: int, timeout_s: float) -> int:
    """The new pid of ``process`` once the router has it alive."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = ray.get(actor.status.remote(), timeout=STATUS_TIMEOUT_S)
        if row["state"] in ("given_up", "failed", "stopped"):
            raise DeployError(f"{process} is {row['state']} after its restart: {row.get('last_event')}")
        pid = row.get("pid")
        if pid not in (None, old_pid):
            ready = ray.get(router.router_ready.remote(), timeout=STATUS_TIMEOUT_S)
            if any(w["worker_id"] == process and w.get("alive") and w.get("pid") == pid
                   for w in ready.get("workers", [])):
                return pid
        time.sleep(0.2)
    raise DeployError(f"{process} was not back within {timeout_s:g} s (drain, restart and registration); "
                      "see `tandem ray status` and its log")


def down(deployment: str | None = None, say: Callable[[str], None] = print) -> list[str]:
    """Stop every process of the deployment(s) (routers first, so requests in flight drain) and kill
    their actors; returns the actor names removed."""
    import ray

    names = deployment_actors(deployment)
    actors = {actor_name: ray.get_actor(actor_name) for actor_name in names}
    answering = _answering(actors)  # an actor Ray never placed (or lost) has no process to stop
    routers = {n: a for n, a in actors.items() if names[n][1] == ROUTER}
    if routers:
        say(f"stopping {', '.join(sorted(routers))} (requests in flight drain first)")
    stop_and_kill(routers, placed=answering)
    workers = {n: a for n, a in actors.items() if n not in routers}
    if workers:
        say(f"stopping {len(workers)} workers")
    stop_and_kill(workers, placed=answering)
    orphans = placement_groups.remove(set(placement_groups.table(deployment)))  # their actors already gone
    if orphans:
        say(f"removed placement groups left without their actors: {', '.join(orphans)}")
    return sorted(actors)


def _answering(actors: dict) -> set[str]:
    """The names of the actors that answer a status call within ``STATUS_TIMEOUT_S``."""
    import ray

    refs = {actor.status.remote(): name for name, actor in actors.items()}
    if not refs:
        return set()
    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=STATUS_TIMEOUT_S)
    return {refs[ref] for ref in done}


def stop_and_kill(actors: dict, placed: set[str] | None = None, wait_s: float | None = 60.0) -> None:
    """Ask every actor ({actor name: handle}; only those in ``placed`` when given) to stop its process,
    in parallel, then kill the actors and remove their placement groups (named as they are); an actor that
    does not answer within ``wait_s`` (None: the actor's own stop bound, its drain) is killed anyway, and its
    process dies with it (``deploy.parent_guard``)."""
    import ray

    refs = [actor.stop.remote() for name, actor in actors.items() if placed is None or name in placed]
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    for actor in actors.values():
        try:
            ray.kill(actor, no_restart=True)
        except (ray.exceptions.RayError, ValueError):
            pass
    deadline = time.monotonic() + 30.0  # ray.kill returns at once: wait until the names are gone
    while actors and time.monotonic() < deadline:
        if not set(ray.util.list_named_actors()) & set(actors):
            break
        time.sleep(0.2)
    placement_groups.remove(set(actors))  # a tensor-parallel worker's group goes with its actor
