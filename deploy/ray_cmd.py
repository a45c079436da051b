"""``tandem ray up|down|status|restart``: Tandem on a running Ray cluster (``pip install -e '.[ray]'`` in the checkout).

``up`` starts the router and the workers as detached, named supervisor actors in the Ray namespace
``tandem`` (``deploy.ray_cluster``); each runs one Tandem process and restarts it when it exits. A worker
with N ranks (``--tensor-parallel-size``, ``--prefill-`` / ``--decode-tensor-parallel-size``) runs them on
one node, reserved as a placement group of N CPUs (``deploy.ray_cluster.rank_groups``).
``status`` shows each process, its node, pid, restarts and readiness; ``down`` stops everything a
deployment started and nothing else; ``restart`` replaces every worker one at a time with no failed
request (a rolling restart). Ray is imported only when one of these runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from deploy.config_flags import add_config_flags, config_from_args
from deploy.keygen_cmd import add_security_flags
from deploy.launch_cmd import add_supervision_flags, add_tensor_parallel_flags, resolve_worker_counts
from deploy.router_preflight import port_number


def register(sub) -> None:
    parser = sub.add_parser("ray", help="deploy on a Ray cluster: tandem ray up|down|status|restart")
    commands = parser.add_subparsers(dest="ray_command", required=True)

    up = commands.add_parser("up", help="start a router and workers as supervised Ray actors")
    _add_common(up, name_default="tandem")
    up.add_argument("--prefill", type=int, default=None, help="PrefillOnly workers (default 1, or 0 with --colocated)")
    up.add_argument("--decode", type=int, default=None, help="DecodeOnly workers (default 1, or 0 with --colocated)")
    up.add_argument("--colocated", type=int, default=0, help="PrefillAndDecode workers (default 0)")
    up.add_argument("--host", default=None, help="the router's HTTP address (default: its node's address)")
    up.add_argument("--port", type=port_number, default=8000, help="the router's HTTP port (default 8000)")
    up.add_argument("--zmq-port", type=int, default=25000,
                    help="the router's ZMQ port; workers connect to tcp://ROUTER_NODE:PORT (default 25000)")
    up.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    up.add_argument("--router-node", default=None, help="address of the node that runs the router (default: head)")
    up.add_argument("--gpus-per-worker", type=float, default=None,
                    help="GPUs each worker takes (default: 1 when the cluster has GPUs, else 0)")
    up.add_argument("--prefill-resources", default=None,
                    help="Ray resources of each prefill worker, JSON, e.g. '{\"prefill\": 1}' to pin them to "
                         "nodes started with that custom resource")
    up.add_argument("--decode-resources", default=None,
                    help="Ray resources of each decode (and colocated) worker, JSON, e.g. '{\"decode\": 1}'")
    up.add_argument("--log-dir", default="/tmp/tandem-ray",
                    help="on each node, where processes log: DIR/NAME/PROCESS.log (default /tmp/tandem-ray)")
    up.add_argument("--ready-timeout", type=float, default=300.0, metavar="SECONDS",
                    help="how long to wait for the router and every worker to be ready before failing (default 300)")
    add_tensor_parallel_flags(up, "A worker's ranks run on one node, in a placement group of a CPU per rank.")
    add_supervision_flags(up, share_cores_help="CPU nodes: let every worker use every core of its node (default: "
                          "prefill and decode workers on one node get disjoint cores, as in tandem up)")
    add_config_flags(up, skip=("pipeline_role", "security"))  # the deployment gives each process its role
    add_security_flags(up, launcher=True)
    up.set_defaults(handler=run_up)

    down = commands.add_parser("down", help="stop every process a deployment started, and its actors; with "
                               "--process, only those workers (a scale-down with no failed request)")
    _add_common(down, name_default=None)
    down.add_argument("--process", action="append", default=None, metavar="NAME",
                      help="remove only this worker (repeatable; e.g. decode-1): it drains first, and a decode "
                           "worker's streams move to the others with their KV; the router and a decode or "
                           "colocated worker must stay")
    down.set_defaults(handler=run_down)

    status = commands.add_parser("status", help="each process: node, pid, restarts, readiness")
    _add_common(status, name_default=None)
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.set_defaults(handler=run_status)

    restart = commands.add_parser("restart", help="replace every worker one at a time with no failed request "
                                  "(drain, restart, wait until registered): after an upgrade of the checkpoint")
    _add_common(restart, name_default=None)
    restart.add_argument("--timeout", type=float, default=300.0,
                         help="seconds each worker may take to drain, restart and register (default 300)")
    restart.set_defaults(handler=run_restart)


def _add_common(parser: argparse.ArgumentParser, name_default: str | None) -> None:
    parser.add_argument("--address", default=None,
                        help="the Ray cluster, HOST:PORT of its head (default: $RAY_ADDRESS, else this node's cluster)")
    parser.add_argument("--name", default=name_default,
                        help="the deployment's name" + (f" (default {name_default})" if name_default
                                                        else " (default: every Tandem deployment on the cluster)"))


def _on_ray(handler):
    """Run ``handler(args, deployment module, operations module)`` connected to the cluster; a ``DeployError`` (no
    Ray installed, no cluster, nothing placeable, not ready) is one line on stderr and exit code 1."""
    def run(args: argparse.Namespace) -> int:
        from deploy.ray_cluster import deployment, operations

        try:
            deployment.connect(args.address)
            return handler(args, deployment, operations)
        except operations.DeployError as exc:
            print(f"tandem ray {args.ray_command}: error: {exc}", file=sys.stderr, flush=True)
            return 1

    return run


def run_up(args: argparse.Namespace) -> int:
    options = _up_options(args)  # bad flags fail here (exit 2), before Ray is touched

    def up(_, deployment, operations) -> int:
        url = deployment.up(options, say=lambda line: print(line, flush=True))
        print(f"Tandem is ready at {url}/v1 (deployment {options.deployment!r}; `tandem ray status` for each "
              f"process, `tandem ray down --name {options.deployment}` to stop)", flush=True)
        return 0

    return _on_ray(up)(args)


def _up_options(args: argparse.Namespace):
    from deploy.ray_cluster.deployment import UpOptions
    from deploy.checkpoint_check import check_checkpoints
    from deploy.ray_cluster.spec import check_deployment_name, parse_resources
    from deploy.tensor_parallel_plan import check_tensor_parallel_workers, worker_tensor_parallel_sizes
    from pipeline.core_list import parse_core_list

    resolve_worker_counts(args)
    config = config_from_args(args)  # every flag and the file section validated before anything starts
    num_ranks = worker_tensor_parallel_sizes(  # what a role cannot run with several ranks: refused here, by flag
        args.prefill or 0, args.decode or 0, args.colocated, config.tensor_parallel_size,
        args.prefill_tensor_parallel_size, args.decode_tensor_parallel_size, device=config.model.device,
        transport=config.transfer.transport)
    given = config.model_fields_set  # set by a flag, the config file or a TANDEM_* variable
    if config.zmq_endpoint_base.startswith("ipc://") and "zmq_endpoint_base" in given:
        raise ValueError("zmq_endpoint_base: a Ray deployment spans nodes, so it needs tcp://HOST:PORT "
                         "(or leave it unset: tcp://ROUTER_NODE:--zmq-port)")
    check_checkpoints(config)  # a checkpoint we cannot serve: one clear error, no actor started
    check_tensor_parallel_workers(config, num_ranks)  # and one its workers of several ranks cannot split
    # Only what the operator set travels: a default written out would read as the operator's choice in
    # every process (the API's max_tokens default among them).
    overrides = config.model_dump(mode="json", exclude={"config_file", "section_name", "pipeline_role"},
                                  exclude_unset=True)
    if overrides.get("bind_host") is None:
        overrides.pop("bind_host", None)  # each worker binds on its own node's address
    cluster_key = _cluster_key_text(config)
    if cluster_key is not None:  # a path on this machine means nothing on the others: the actors get the key
        overrides.get("security", {}).pop("cluster_key_file", None)
    return UpOptions(
        num_prefill=args.prefill or 0, num_decode=args.decode or 0, num_colocated=args.colocated,
        deployment=check_deployment_name(args.name), config=overrides, http_port=args.port, http_host=args.host,
        zmq_port=args.zmq_port, api_key=args.api_key, log_dir=args.log_dir, max_restarts=args.max_restarts,
        watchdog_timeout_s=args.watchdog_timeout,
        ready_timeout_s=args.ready_timeout, router_node=args.router_node, gpus_per_worker=args.gpus_per_worker,
        prefill_resources=parse_resources(args.prefill_resources, "--prefill-resources"),
        decode_resources=parse_resources(args.decode_resources, "--decode-resources"),
        share_cores=args.share_cores,
        cpu_pool=parse_core_list(config.cpu_cores) if config.cpu_cores else None, cluster_key=cluster_key,
        num_ranks={name: size for name, size in num_ranks.items() if size > 1},
    )


def _cluster_key_text(config) -> str | None:
    """The cluster key every process gets: the operator's file (checked here), else a fresh one; None
    only when the operator chose an insecure cluster."""
    from pipeline.security import cluster_key_text, load_cluster_key

    if config.security.cluster_key_file:
        load_cluster_key(config.security.cluster_key_file)  # a bad file: one clear error, no actor started
        with open(config.security.cluster_key_file) as f:
            return f.read()
    return None if config.security.insecure_cluster else cluster_key_text()


@_on_ray
def run_down(args: argparse.Namespace, deployment, operations) -> int:
    if args.process:
        removed = operations.scale_down(args.name, args.process, say=lambda line: print(line, flush=True))
        print(f"removed {len(removed)} workers: {', '.join(removed)}", flush=True)
        return 0
    removed = operations.down(args.name, say=lambda line: print(line, flush=True))
    what = f"deployment {args.name!r}" if args.name else "every Tandem deployment"
    print(f"stopped {what}: {len(removed)} processes and their actors" if removed else f"{what}: nothing running",
          flush=True)
    return 0


@_on_ray
def run_restart(args: argparse.Namespace, deployment, operations) -> int:
    replaced = operations.rolling_restart(args.name, say=lambda line: print(line, flush=True), timeout_s=args.timeout)
    print(f"replaced {len(replaced)} workers one at a time", flush=True)
    return 0


@_on_ray
def run_status(args: argparse.Namespace, deployment, operations) -> int:
    rows = operations.status(args.name)
    if args.json:
        print(json.dumps(rows, indent=2), flush=True)
    elif not rows and args.name:  # as `tandem ray down --name` says it
        print(f"tandem ray status: error: no Tandem deployment {args.name!r} is running on this Ray cluster",
              file=sys.stderr, flush=True)
        return 1
    elif not rows:
        print("no Tandem deployment is running on this Ray cluster", flush=True)
    else:
        print(format_status(rows), flush=True)
    return 0


def format_status(rows: list[dict]) -> str:
    """A table: deployment, process, state, node, pid, restarts, ready, log; then the router URLs."""
    header = ("DEPLOYMENT", "PROCESS", "STATE", "NODE", "PID", "RESTARTS", "READY", "LOG")
    table = [header] + [(
        row.get("deployment", ""), row.get("name", ""), row.get("state", ""), row.get("node_ip") or "-",
        str(row.get("pid") or "-"), str(row.get("restarts", "-")), "yes" if row.get("ready") else "no",
        row.get("log") or "-") for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in table]
    lines += [f"{row['deployment']}: {row['url']}/v1" for row in rows if row.get("url")]
    lines += [f"{row['deployment']}/{row['name']}: {row['last_event']}" for row in rows
              if row.get("state") not in ("running",) and row.get("last_event")]
    return "\n".join(lines)
