"""The driver side of ``tandem ray``: bring a deployment up on a running Ray cluster, report it, take it down.

``up`` creates one detached supervisor actor per process (``deploy.ray_cluster.process_actor``), a
tensor-parallel worker's inside its own placement group (``deploy.ray_cluster.rank_groups``), waits
until Ray has placed them all, splits each CPU node's cores, starts the router and then the workers,
and waits until the router reports every worker alive. Anything that goes wrong on the way stops
what was started, so a failed ``up`` leaves nothing behind. The actors are detached: they outlive
the driver, and ``down`` (from any machine that reaches the cluster) finds them by name.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from deploy.ray_cluster import placement_groups
from deploy.ray_cluster import spec as specs
from deploy.ray_cluster.process_actor import ProcessSupervisor
from deploy.ray_cluster.spec import NAMESPACE, ROUTER, ProcessSpec

logger = logging.getLogger(__name__)

PLACEMENT_POLL_S = 0.5
STATUS_TIMEOUT_S = 10.0


class DeployError(RuntimeError):
    """``tandem ray`` could not do what was asked; the message says why and what to look at."""


@dataclass
class UpOptions:
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0
    deployment: str = "tandem"
    config: dict = field(default_factory=dict)  # PipelineConfig overrides for every process
    http_port: int = 8000
    http_host: str | None = None  # None: the router node's address
    zmq_port: int = 25000
    api_key: str | None = None
    log_dir: str = "/tmp/tandem-ray"
    max_restarts: int = 5
    ready_timeout_s: float = 300.0
    router_node: str | None = None  # a node address; None: the head node
    gpus_per_worker: float | None = None  # None: 1 when the cluster has GPUs, else 0
    prefill_resources: dict = field(default_factory=dict)
    decode_resources: dict = field(default_factory=dict)
    share_cores: bool = False
    cpu_pool: list[int] | None = None  # the user's cpu_cores, applied on every node
    cluster_key: str | None = field(default=None, repr=False)  # the key file's text, given to every process
    num_ranks: dict = field(default_factory=dict)  # {worker name: tensor_parallel_size}, absent: 1


def connect(address: str | None) -> None:
    """Join the Ray cluster at ``address`` (default: ``RAY_ADDRESS``, else the cluster on this node)."""
    try:
        import ray
    except ImportError:
        raise DeployError("Ray is not installed: pip install 'tandem[ray]'") from None

    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    _check_reachable(address)
    try:
        ray.init(address=address, namespace=NAMESPACE,
                 log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise DeployError(f"cannot connect to a Ray cluster at {address or 'auto'}: {exc}. Start one with "
                          "`ray start --head` or `ray up`, and pass its address with --address HOST:PORT") from None


def _check_reachable(address: str) -> None:
    """Fail in seconds on a HOST:PORT nobody listens on (``ray.init`` would retry for minutes)."""
    host, sep, port = address.rpartition(":")
    if address == "auto" or "://" in address or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5.0).close()
    except OSError as exc:
        raise DeployError(f"no Ray cluster at {address} ({exc}); start one with `ray start --head` or `ray up`, "
                          "and pass its head's HOST:PORT with --address") from None


# ------------------------------------------------------------------- up
def up(options: UpOptions, say: Callable[[str], None] = print) -> str:
    """Deploy; returns the router's URL once every worker is alive."""
    import ray

    existing = sorted(deployment_actors(options.deployment)) + sorted(placement_groups.table(options.deployment))
    if existing:
        raise DeployError(f"deployment {options.deployment!r} is already running ({', '.join(existing)}); "
                          f"`tandem ray down --name {options.deployment}` first, or choose another --name")
    router_ip = _router_node_ip(options.router_node)
    gpus = options.gpus_per_worker
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    config = {**options.config, "zmq_endpoint_base": options.config.get("zmq_endpoint_base")
              or f"tcp://{router_ip}:{options.zmq_port}"}
    env = {"TANDEM_API_KEY": options.api_key} if options.api_key else {}
    log_dir = os.path.join(options.log_dir, options.deployment)
    names = specs.process_names(options.num_prefill, options.num_decode, options.num_colocated)
    up_id = uuid.uuid4().hex
    try:  # a tensor-parallel worker's placement group, checked against the live nodes before anything starts
        bundles = placement_groups.bundles(names, options.num_ranks, gpus, options.prefill_resources,
                                           options.decode_resources)
    except ValueError as exc:
        raise DeployError(str(exc)) from None
    actors = {}
    where: dict[str, dict] = {}  # filled as Ray places the actors
    remote_cls = ray.remote(ProcessSupervisor)
    try:
        for name in names:
            spec = ProcessSpec(options.deployment, name, config, log_dir, options.max_restarts,
                               http_port=options.http_port, http_host=options.http_host, env=env,
                               cluster_key=options.cluster_key, num_ranks=options.num_ranks.get(name, 1), up_id=up_id)
            if name == ROUTER:
                placement = specs.actor_options({}, pin_to=specs.router_pin(options.router_node))
            elif name in bundles:
                group = placement_groups.create(spec.actor_name, bundles[name])
                placement = placement_groups.actor_options(group, bundles[name])
            else:
                resources = specs.worker_resources(name, gpus, options.prefill_resources, options.decode_resources)
                placement = specs.actor_options(resources, spread=not resources)
            actors[name] = remote_cls.options(
                name=spec.actor_name, namespace=NAMESPACE, lifetime="detached", max_restarts=options.max_restarts,
                max_concurrency=4, **placement).remote(spec)
        say(f"placing {len(actors)} supervisor actors ({_describe_resources(gpus, options)})")
        _wait_placed(actors, where, options.ready_timeout_s, bundles)
        cores = {} if gpus else specs.plan_node_cores(
            where, share=options.share_cores, pool_limit=options.cpu_pool,
            held={name: int(bundle["CPU"]) for name, bundle in bundles.items()})
        for name, info in where.items():
            say(f"  {name}: node {info['node_ip']}{_describe_placement(name, cores.get(name), options, bundles)}")
        ray.get(actors[ROUTER].start.remote(cores.get(ROUTER)))
        ray.get([actor.start.remote(cores.get(name)) for name, actor in actors.items() if name != ROUTER])
        url = ray.get(actors[ROUTER].status.remote())["url"]
        _wait_ready(actors, options.ready_timeout_s)
        return url
    except BaseException:  # stop what started (an actor Ray never placed has nothing to stop), kill every actor
        _stop_and_kill({specs.actor_name(options.deployment, name): actor for name, actor in actors.items()},
                       placed={specs.actor_name(options.deployment, name) for name in where})
        placement_groups.remove(set(placement_groups.table(options.deployment)))  # one made before its actor failed
        raise


def _describe_placement(name: str, cores: list[int] | None, options: UpOptions, bundles: dict) -> str:
    """", cores 0-1 (rank 0: 0; rank 1: 1), placement group tandem:colocated-0 {CPU: 2}" (what applies)."""
    from pipeline.cpu_placement import rank_cores

    text = ""
    if cores:
        shares = rank_cores(cores, options.num_ranks.get(name, 1))
        ranks = "; ".join(f"rank {rank}: {_fmt(share)}" for rank, share in enumerate(shares))
        text += f", cores {_fmt(cores)}" + (f" ({ranks})" if len(shares) > 1 else "")
    if name in bundles:
        bundle = ", ".join(f"{key}: {amount:g}" for key, amount in sorted(bundles[name].items()))
        text += f", placement group {specs.actor_name(options.deployment, name)} {{{bundle}}}"
    return text


def _router_node_ip(router_node: str | None) -> str:
    """The router's node address: the head node's, or ``router_node`` checked against the cluster."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if router_node is not None:
        if not any(n["NodeManagerAddress"] == router_node for n in nodes):
            raise DeployError(f"--router-node {router_node}: no live Ray node has that address "
                              f"(nodes: {', '.join(sorted(n['NodeManagerAddress'] for n in nodes))})")
        return router_node
    heads = [n["NodeManagerAddress"] for n in nodes if "node:__internal_head__" in n.get("Resources", {})]
    if not heads:
        raise DeployError("the Ray cluster reports no head node; name the router's node with --router-node ADDRESS")
    return heads[0]


def _wait_placed(actors: dict, where: dict[str, dict], timeout_s: float, bundles: dict | None = None) -> None:
    """Fill ``where`` with {name: where()} as Ray places the actors; an error naming the ones it could
    not place within ``timeout_s`` (and the placement groups among them that Ray could not reserve)."""
    import ray

    pending = {actor.where.remote(): name for name, actor in actors.items()}
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=PLACEMENT_POLL_S)
        for ref in done:
            where[pending.pop(ref)] = ray.get(ref)
    if pending:
        unplaced = sorted(pending.values())
        groups = [f"{name}'s placement group {bundles[name]} (all its ranks on one node)"
                  for name in unplaced if name in (bundles or {})]
        raise DeployError(f"Ray could not place {', '.join(unplaced)} within {timeout_s:g} s: no node has the "
                          f"resources they ask for{' (' + '; '.join(groups) + ')' if groups else ''} "
                          f"(cluster: {ray.available_resources()}); see `ray status`")


def _wait_ready(actors: dict, timeout_s: float) -> None:
    """Until the router is ready with every worker alive; fails fast on a process given up."""
    import ray

    expected = set(actors) - {ROUTER}
    deadline = time.monotonic() + timeout_s
    body: dict = {}
    while time.monotonic() < deadline:
        for name, status in zip(actors, ray.get([a.status.remote() for a in actors.values()])):
            if status["state"] in ("given_up", "failed"):
                tail = ray.get(actors[name].log_tail.remote())
                raise DeployError(f"{name} on {status['node_ip']} keeps exiting ({status['last_event']}); "
                                  f"log {status['log']}:\n{tail}")
        body = ray.get(actors[ROUTER].router_ready.remote())
        alive = {w["worker_id"] for w in body.get("workers", []) if w.get("alive")}
        if body.get("ready") and expected <= alive:
            return
        time.sleep(0.5)
    raise DeployError(f"not ready after {timeout_s:g} s (router says: {body}); `tandem ray status` shows each "
                      "process and its log")


# ------------------------------------------------------- status, down
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
        _stop_and_kill({actor_name: ray.get_actor(actor_name)}, wait_s=None)
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
    _stop_and_kill(routers, placed=answering)
    workers = {n: a for n, a in actors.items() if n not in routers}
    if workers:
        say(f"stopping {len(workers)} workers")
    _stop_and_kill(workers, placed=answering)
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


def _stop_and_kill(actors: dict, placed: set[str] | None = None, wait_s: float | None = 60.0) -> None:
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


def _describe_resources(gpus: float, options: UpOptions) -> str:
    parts = [f"router on {options.router_node or 'the head node'}", f"{gpus:g} GPU per worker"]
    if options.prefill_resources:
        parts.append(f"prefill {options.prefill_resources}")
    if options.decode_resources:
        parts.append(f"decode {options.decode_resources}")
    if not gpus:
        parts.append("cores split per node" + (" (shared)" if options.share_cores else ""))
    return ", ".join(parts)


def _fmt(cores: list[int]) -> str:
    from pipeline.core_list import format_core_list

    return format_core_list(cores)
