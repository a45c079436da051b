"""What ``tandem ray up`` deploys, decided before any actor exists (pure: no Ray import).

A deployment is a named set of processes: one router and N prefill / M decode / K colocated
workers. Each runs under its own supervisor actor, named ``{deployment}:{process}`` in the Ray
namespace ``tandem`` (``tandem:router``, ``tandem:prefill-0``, ...), so ``tandem ray status`` and
``tandem ray down`` find exactly what Tandem started and nothing else.

Placement, as Ray actor options:

* the router on the head node (Ray's ``node:__internal_head__`` resource), or on the node whose
  address the user names (``node:<ip>``); it never moves, so its address is fixed for the workers;
* workers with ``num_gpus`` each (1 on a cluster with GPUs), plus the custom resources the user gives
  per role (``--prefill-resources '{"prefill": 1}'``) so roles can be pinned to node types; with no
  resources to steer them, workers are spread over the nodes (Ray's ``SPREAD``);
* a worker of several ranks in a placement group of its own, one node for all its ranks
  (``deploy.ray_cluster.rank_groups``).

On CPU nodes the same core split as ``tandem up`` (``deploy.cpu_plan``) is made per node, once the
actors are placed and each has said where it runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from deploy.cpu_plan import plan_cores, router_cores
from deploy.local_launcher import worker_names
from deploy.ray_cluster.rank_groups import reserve_cores

NAMESPACE = "tandem"  # every supervisor actor lives here
ROUTER = "router"
ROLE_OF_PREFIX = {"prefill": "PrefillOnly", "decode": "DecodeOnly", "colocated": "PrefillAndDecode"}
_HEAD_RESOURCE = "node:__internal_head__"
_PIN_AMOUNT = 0.001  # a sliver of a node's own resource: pins the actor without taking anything from it
_RAY_STANDARD = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": "memory"}


@dataclass(frozen=True)
class ProcessSpec:
    """One supervised process; everything its actor needs to start it, and to start it again after
    Ray restarts the actor (Ray passes the same constructor arguments)."""

    deployment: str
    name: str  # "router", "prefill-0", ...; a worker's name is also its worker id
    config: dict  # PipelineConfig overrides (zmq_endpoint_base included), written to a file on the node
    log_dir: str  # on the process's node
    max_restarts: int
    http_port: int = 8000  # the router's
    http_host: str | None = None  # the router's; None = its node's address
    env: dict = field(default_factory=dict)  # set in the process's environment (e.g. TANDEM_API_KEY)
    # The cluster key file's text (docs/security.md); the actor writes it owner-only beside the log
    cluster_key: str | None = field(default=None, repr=False)
    num_ranks: int = 1  # a worker's tensor_parallel_size: above 1, its actor runs in its placement group
    up_id: str = ""  # one per ``tandem ray up``: a restarted actor reuses only its own deployment's core plan
    watchdog_timeout_s: float = 30.0  # a running process silent this long is killed (deploy.watchdog); 0: never

    @property
    def actor_name(self) -> str:
        return actor_name(self.deployment, self.name)

    @property
    def is_router(self) -> bool:
        return self.name == ROUTER

    @property
    def role(self) -> str:
        """"router", or the worker's ``pipeline_role``."""
        return ROUTER if self.is_router else ROLE_OF_PREFIX[self.name.split("-")[0]]

    def cli_args(self, node_ip: str) -> list[str]:
        """The ``tandem`` subcommand and its flags (the config file and cores are added by the actor)."""
        if self.is_router:
            return [ROUTER, "--host", self.http_host or node_ip, "--port", str(self.http_port)]
        ranks = ["--tensor-parallel-size", str(self.num_ranks)] if self.num_ranks != self.config.get(
            "tensor_parallel_size", 1) else []  # as tandem up: only a size other than the config's
        return ["worker", "--role", self.role, "--worker-id", self.name, *ranks]


def actor_name(deployment: str, process: str) -> str:
    return f"{deployment}:{process}"


def split_actor_name(name: str) -> tuple[str, str] | None:
    """"tandem:prefill-0" -> ("tandem", "prefill-0"); None for a name Tandem does not make."""
    deployment, sep, process = name.rpartition(":")
    if not sep or not deployment or not (process == ROUTER or process.split("-")[0] in ROLE_OF_PREFIX):
        return None
    return deployment, process


def check_deployment_name(name: str) -> str:
    if not name or ":" in name or not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"--name: letters, digits, '-' and '_' only (got {name!r})")
    return name


def parse_resources(text: str | None, flag: str) -> dict[str, float]:
    """``'{"prefill": 1, "GPU": 1}'`` -> {"prefill": 1.0, "GPU": 1.0}; a clear error naming ``flag``."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not JSON ({exc.msg}); write e.g. '{{\"prefill\": 1}}'") from None
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{flag}: must be a JSON object of resource name -> amount, e.g. '{{\"prefill\": 1}}'")
    resources = {}
    for name, amount in value.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
            raise ValueError(f"{flag}: {name!r} needs a number >= 0 (got {amount!r})")
        resources[str(name)] = float(amount)
    return resources


def actor_options(resources: dict[str, float], pin_to: str | None = None, spread: bool = False) -> dict:
    """Ray actor options from a resource dict: CPU/GPU/memory become ``num_cpus``/``num_gpus``/``memory``
    (Ray refuses them in ``resources``); ``pin_to`` is a node resource such as ``node:10.0.0.5``.
    A supervisor takes no CPU of its own (``num_cpus=0``): its process's cores are the core plan's."""
    options: dict = {"num_cpus": 0}
    custom = {}
    for name, amount in resources.items():
        if name in _RAY_STANDARD:
            options[_RAY_STANDARD[name]] = int(amount) if name == "memory" else amount
        else:
            custom[name] = amount
    if pin_to is not None:
        custom[pin_to] = _PIN_AMOUNT
    if custom:
        options["resources"] = custom
    if spread:
        options["scheduling_strategy"] = "SPREAD"
    return options


def router_pin(router_node: str | None) -> str:
    """The node resource that holds the router: the head node, or ``node:<router_node>``."""
    return _HEAD_RESOURCE if router_node is None else f"node:{router_node}"


def worker_resources(name: str, gpus_per_worker: float, prefill: dict[str, float],
                     decode: dict[str, float]) -> dict[str, float]:
    """A worker's resources: its role's custom resources (decode's for colocated workers too), and
    ``gpus_per_worker`` GPUs unless the role's resources say how many."""
    resources = dict(prefill if name.startswith("prefill-") else decode)
    if gpus_per_worker and "GPU" not in resources:
        resources["GPU"] = gpus_per_worker
    return resources


def process_names(num_prefill: int, num_decode: int, num_colocated: int) -> list[str]:
    """The router first, then the workers as ``tandem up`` names them."""
    return [ROUTER, *worker_names(num_prefill, num_decode, num_colocated)]


def plan_node_cores(where: dict[str, dict], share: bool = False, pool_limit: list[int] | None = None,
                    held: dict[str, int] | None = None) -> dict[str, list[int]]:
    """{process name: cores} for CPU nodes: on each node the workers placed there split that node's
    cores as ``tandem up`` would (prefill apart from decode), and a router beside workers gets the
    cores ``tandem up`` would give it; a router alone on its node is not bound.

    ``where``: {process name: {"node_id": ..., "cores": [cores its actor may use]}} from the actors.
    ``pool_limit``: the user's ``cpu_cores``, applied on every node.
    ``held``: {worker name: CPUs its placement group holds} (tensor-parallel workers): each gets that many
    cores of its node to itself first (``rank_groups.reserve_cores``), the others split the rest (all the
    pool if nothing is left). ``share``, or a pool with fewer cores than the groups hold: every worker
    planned together as ``tandem up`` plans them, a worker of N ranks counting N times.
    """
    by_node: dict[str, list[str]] = {}
    for name, info in where.items():
        by_node.setdefault(info["node_id"], []).append(name)
    plan: dict[str, list[int]] = {}
    for names in by_node.values():
        pool = sorted(set(where[names[0]]["cores"]) & set(pool_limit) if pool_limit else where[names[0]]["cores"])
        if not pool:
            raise ValueError(f"cpu_cores: none of {pool_limit} is available on the node of {names}")
        workers = [n for n in names if n != ROUTER]
        if not workers:
            continue
        node_held = {n: (held or {})[n] for n in workers if n in (held or {})}
        reserved: dict[str, list[int]] = {}
        if node_held and not share and len(pool) > 1 and sum(node_held.values()) <= len(pool):
            reserved, left = reserve_cores(pool, node_held)
            pool, node_held = left or pool, {}
        plan.update(reserved)
        plan.update(_plan_tandem_up(pool, [n for n in workers if n not in reserved], node_held, share))
        if ROUTER in names:
            plan[ROUTER] = router_cores({n: plan[n] for n in workers})
    return plan


def _plan_tandem_up(pool: list[int], workers: list[str], num_ranks: dict[str, int], share: bool) -> dict[str, list[int]]:
    """``tandem up``'s plan of ``workers`` (global names) over one node's ``pool``."""
    if not workers:
        return {}
    counts = {prefix: [n for n in workers if n.startswith(prefix + "-")] for prefix in ROLE_OF_PREFIX}
    local_names = {global_name: f"{prefix}-{index}" for prefix, global_names in counts.items()
                   for index, global_name in enumerate(global_names)}  # this node's workers as tandem up names them
    local = plan_cores(pool, len(counts["prefill"]), len(counts["decode"]), len(counts["colocated"]), share,
                       num_ranks={local_names[n]: size for n, size in num_ranks.items()})
    return {global_name: local[local_name] for global_name, local_name in local_names.items()}
