"""The driver side of ``tandem ray``: bring a deployment up on a running Ray cluster, report it, take it down.

``up`` creates one detached supervisor actor per process (``deploy.ray_cluster.process_actor``), a
tensor-parallel worker's inside its own placement group (``deploy.ray_cluster.rank_groups``), waits
until Ray has placed them all, splits each CPU node's cores, starts the router and then the workers,
and waits until the router reports every worker alive. Anything that goes wrong on the way stops
what was started, so a failed ``up`` leaves nothing behind. The actors are detached: they outlive
the driver; what acts on a running deployment (status, rolling restart, scale-down, down) is
``deploy.ray_cluster.operations``, which finds them by name from any machine that reaches the cluster.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from deploy.keygen_cmd import API_KEY_ENV
from deploy.local_spawner import CHILD_LOG_LEVEL_ENV
from deploy.ray_cluster import placement_groups
from deploy.ray_cluster import spec as specs
from deploy.ray_cluster.operations import DeployError, deployment_actors, stop_and_kill
from deploy.ray_cluster.process_actor import ProcessSupervisor
from deploy.ray_cluster.spec import NAMESPACE, ROUTER, ProcessSpec

logger = logging.getLogger(__name__)

PLACEMENT_POLL_S = 0.5


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
    watchdog_timeout_s: float = 30.0  # a running process silent this long is killed and restarted; 0: never
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
        raise DeployError("Ray is not installed: pip install -e '.[ray]' in Tandem's checkout") from None

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
    env = {API_KEY_ENV: options.api_key} if options.api_key else {}
    if os.environ.get(CHILD_LOG_LEVEL_ENV):  # `tandem --log-level X ray up`: its processes log at X too
        env[CHILD_LOG_LEVEL_ENV] = os.environ[CHILD_LOG_LEVEL_ENV]
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
                               cluster_key=options.cluster_key, num_ranks=options.num_ranks.get(name, 1), up_id=up_id,
                               watchdog_timeout_s=options.watchdog_timeout_s)
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
        stop_and_kill({specs.actor_name(options.deployment, name): actor for name, actor in actors.items()},
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
    """Until the router is ready with every worker alive; fails fast on a process given up or on a port another
    router answers."""
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
        if body.get("port_taken"):  # its router cannot bind the port: no wait makes it ready
            raise DeployError(body["error"])
        alive = {w["worker_id"] for w in body.get("workers", []) if w.get("alive")}
        if body.get("ready") and expected <= alive:
            return
        time.sleep(0.5)
    raise DeployError(f"not ready after {timeout_s:g} s (router says: {body}); `tandem ray status` shows each "
                      "process and its log")


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
