"""``tandem up``: a whole local cluster (router + workers as separate processes) until Ctrl-C.

A process that exits is restarted (``--max-restarts`` crashes in a row, with backoff; see
``deploy.supervisor``) and every restart is printed. SIGHUP (``kill -HUP <pid>``) replaces every worker
one at a time, each drained first (``LocalCluster.rolling_restart``): an upgrade with no failed request. ``tandem up`` exits 0 after Ctrl-C / SIGTERM (the
router drains first), and 1 when the cluster cannot serve any more: the router or every decode-capable
worker crashed past the limit.

Workers are bound to cores (``deploy.cpu_plan``): prefill and decode workers apart, out of the pool
``--cpu-cores`` names (default: every core ``tandem up`` may use); ``--share-cores`` gives each the whole pool.
A worker with ``--tensor-parallel-size`` N counts N times in that split, and each of its ranks gets its own
cores (``deploy.tensor_parallel_plan``: colocated workers only, for now).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from deploy.config_flags import add_config_flags, config_from_args
from deploy.keygen_cmd import API_KEY_ENV, add_http_security_flags, add_security_flags, parse_api_keys
from deploy.router_preflight import check_router_can_start, port_number


def register(sub) -> None:
    parser = sub.add_parser(
        "up", help="start a local cluster: router, prefill and decode workers",
        usage="tandem up [--prefill N] [--decode N] [--colocated N] [--model PATH] [--port PORT] "
              "[--tensor-parallel-size N] [options]",
        description="Start a router and workers on this host, each its own process, until Ctrl-C / SIGTERM "
                    "(which drains first). A process that exits is restarted; SIGHUP replaces every worker "
                    "one at a time.")
    parser.add_argument("--prefill", type=int, default=None, metavar="N",
                        help="prefill workers (PrefillOnly; default 1, or 0 with --colocated)")
    parser.add_argument("--decode", type=int, default=None, metavar="N",
                        help="decode workers (DecodeOnly; default 1, or 0 with --colocated)")
    parser.add_argument("--colocated", type=int, default=0, metavar="N",
                        help="colocated workers that prefill and decode themselves (PrefillAndDecode; default 0)")
    parser.add_argument("--host", default="127.0.0.1", help="address the HTTP API listens on (default 127.0.0.1)")
    parser.add_argument("--port", type=port_number, default=8000, help="port of the HTTP API (default 8000)")
    add_http_security_flags(parser, api_key_default=os.environ.get(API_KEY_ENV),
                            api_key_default_text="$TANDEM_API_KEY")  # as tandem router (its router would read it)
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="where each process logs (default: a temp dir)")
    parser.add_argument("--ready-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="give up if the cluster is not serving by then (default 300)")
    add_tensor_parallel_flags(parser, "Each rank gets its own cores of the plan.")
    add_supervision_flags(parser, share_cores_help="let every worker use every core of the pool (default: prefill and "
                          "decode workers get disjoint cores; the pool is --cpu-cores, else every core this process may use)")
    add_config_flags(parser, skip=("pipeline_role", "security"))  # the launcher gives each process its role
    add_security_flags(parser, launcher=True)
    parser.set_defaults(handler=run)


def add_tensor_parallel_flags(parser, placement: str) -> None:
    """The per-role flags (``--tensor-parallel-size`` itself is a config field's flag); ``placement`` says where a
    worker's ranks run under the launcher that adds them."""
    parser.add_argument("--prefill-tensor-parallel-size", type=int, default=None, metavar="A",
                        help="ranks of each prefill worker (default: --tensor-parallel-size); its KV reaches decode "
                        f"workers of any rank count, re-sliced (CPU). {placement}")
    parser.add_argument("--decode-tensor-parallel-size", type=int, default=None, metavar="B",
                        help="ranks of each decode worker (default: --tensor-parallel-size); it receives KV from "
                        "prefill workers of any rank count, re-sliced (CPU). Colocated workers take "
                        "--tensor-parallel-size")


def add_supervision_flags(parser: argparse.ArgumentParser, share_cores_help: str) -> None:
    """``--max-restarts`` and ``--share-cores``, shared by ``tandem up`` and ``tandem ray up``."""
    parser.add_argument("--max-restarts", type=int, default=5, metavar="N",
                        help="restart a process that exits up to N times in a row, with backoff; 0: never (default 5)")
    parser.add_argument("--watchdog-timeout", type=float, default=30.0, metavar="S",
                        help="kill and restart a process that gives no sign of life for S seconds while it runs "
                        "(frozen: SIGSTOP, a debugger, a wedged event loop); 0: never (default 30)")
    parser.add_argument("--share-cores", action="store_true", help=share_cores_help)


def resolve_worker_counts(args: argparse.Namespace) -> None:
    """``tandem up``'s and ``tandem ray up``'s ``--max-restarts`` and worker counts checked, and each role's
    default filled in (1 prefill and 1 decode worker, none with ``--colocated``; ``--decode 2`` alone is 1P2D)."""
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts: must be >= 0 (got {args.max_restarts})")
    if not args.watchdog_timeout >= 0:  # NaN too
        raise ValueError(f"--watchdog-timeout: must be >= 0 (got {args.watchdog_timeout:g})")
    if not args.ready_timeout > 0:  # it started everything, then failed "not ready after -5s"
        raise ValueError(f"--ready-timeout: must be > 0 (got {args.ready_timeout:g})")
    for flag in ("prefill", "decode", "colocated"):
        if (getattr(args, flag) or 0) < 0:
            raise ValueError(f"--{flag}: a number of workers is >= 0 (got {getattr(args, flag)})")
    default_count = 0 if args.colocated else 1
    args.prefill = default_count if args.prefill is None else args.prefill
    args.decode = default_count if args.decode is None else args.decode
    if args.decode + args.colocated == 0:
        raise ValueError("a deployment needs at least one decode or colocated worker")


def run(args: argparse.Namespace) -> int:
    from deploy.checkpoint_check import check_checkpoints
    from deploy.cpu_plan import describe_plan, plan_cores, router_cores
    from deploy.local_launcher import ClusterError, LocalCluster
    from deploy.tensor_parallel_plan import check_tensor_parallel_workers, worker_tensor_parallel_sizes
    from pipeline.config import config_env_names
    from pipeline.core_list import format_core_list
    from pipeline.cpu_placement import allowed_cores

    resolve_worker_counts(args)
    if args.port == 0:  # the launcher waits for the router on that port, and the banner names it
        raise ValueError("--port: tandem up needs a fixed port (got 0, any free port); pick one, e.g. 8000")
    config = config_from_args(args)  # validates every flag and the file section before anything starts
    # the TANDEM_* variables are merged into the config the processes get (below the flags): were the processes to
    # inherit them too, they would apply them again, over the flags
    for name in config_env_names(os.environ):
        del os.environ[name]
    check_checkpoints(config)  # a checkpoint we cannot serve: one clear error, nothing started
    api_key = _checked_http_security(args, config)
    tensor_parallel_sizes = worker_tensor_parallel_sizes(
        args.prefill or 0, args.decode or 0, args.colocated, config.tensor_parallel_size,
        args.prefill_tensor_parallel_size, args.decode_tensor_parallel_size, device=config.model.device,
        transport=config.transfer.transport)  # what a role cannot run with several ranks: refused here
    check_tensor_parallel_workers(config, tensor_parallel_sizes)  # and what this checkpoint cannot split
    pool = allowed_cores(config.cpu_cores)  # a core that is not ours is an error here, not in every worker
    cpu_plan = plan_cores(pool, args.prefill or 0, args.decode or 0, args.colocated, share=args.share_cores,
                          num_ranks=tensor_parallel_sizes)
    router_pool = router_cores(cpu_plan)
    # Only what the operator set (flag, file section, TANDEM_* variable) travels: a default written out
    # would read as the operator's choice in every process (the API's max_tokens default among them).
    overrides = config.model_dump(mode="json", exclude={"config_file", "section_name", "pipeline_role"},
                                  exclude_unset=True)
    # what would stop the router (a port in use, TLS files that do not load, an ipc directory that is not there)
    # is said now, before any worker has started
    check_router_can_start(overrides.get("zmq_endpoint_base"), args.host, args.port, args.ssl_keyfile,
                           args.ssl_certfile)
    cluster = LocalCluster(
        num_prefill=args.prefill or 0, num_decode=args.decode or 0, num_colocated=args.colocated,
        host=args.host, port=args.port, config=overrides, api_key=api_key, log_dir=args.log_dir,
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        max_restarts=args.max_restarts, watchdog_timeout_s=args.watchdog_timeout, on_event=_print_event, cpu_plan=cpu_plan, router_cores=router_pool,
        tensor_parallel_sizes={name: size for name, size in tensor_parallel_sizes.items()
                               if size != config.tensor_parallel_size},
    )
    stop = threading.Event()

    def on_signal(*_) -> None:
        if stop.is_set():  # the second Ctrl-C / SIGTERM: no more waiting for requests in flight
            print("stopping at once", flush=True)
            cluster.force_stop()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    restarting = threading.Lock()

    def rolling_restart() -> None:
        if not restarting.acquire(blocking=False):
            print("a rolling restart is already running", flush=True)
            return
        try:
            print("rolling restart: replacing every worker, one at a time", flush=True)
            cluster.rolling_restart()
            print("rolling restart done", flush=True)
        except ClusterError as exc:
            print(f"rolling restart stopped: {exc}", file=sys.stderr, flush=True)
        finally:
            restarting.release()

    signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=rolling_restart, daemon=True).start())
    if config.model.model_path is None:
        from pipeline.builtin_model import BUILTIN_NOTICE

        print(BUILTIN_NOTICE, flush=True)
    print(f"cpu plan: {describe_plan(cpu_plan, config.num_threads, tensor_parallel_sizes)} | router: cores {format_core_list(router_pool)}",
          flush=True)
    print(f"starting {len(cluster.worker_names)} workers and the router; logs in {cluster.log_dir}", flush=True)
    try:
        try:
            cluster.start(timeout_s=args.ready_timeout)
        except ClusterError as exc:
            print(f"tandem up: error: {exc}", file=sys.stderr, flush=True)
            return 1
        print(f"Tandem is ready at {cluster.url}/v1 (model: {_served_as(config)}); Ctrl-C to stop", flush=True)
        print("pids: " + ", ".join(f"{name} {pid}" for name, pid in cluster.pids.items()), flush=True)
        print(f"kill -HUP {os.getpid()} replaces every worker one at a time, with no failed request", flush=True)
        while not stop.wait(0.5):
            if cluster.failure is not None:
                print(f"tandem up: error: the cluster cannot serve: {cluster.failure}; "
                      f"see {cluster.log_dir}/launcher.log", file=sys.stderr, flush=True)
                return 1
    finally:
        print(f"shutting down: requests in flight get {config.drain_timeout_s:g} s to finish "
              "(Ctrl-C again to stop at once)...", flush=True)
        cluster.stop()
    return 0


def _checked_http_security(args: argparse.Namespace, config) -> str | None:
    """Fail before anything starts on a bad --api-key, TLS pair or cluster key; returns the router's
    --api-key with an @FILE made absolute. With none given, the cluster makes its own cluster key."""
    from pipeline.security import load_cluster_key

    if config.security.cluster_key_file:
        load_cluster_key(config.security.cluster_key_file)
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together (the certificate and its private key)")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile)):
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag}: no such file {path!r}")
    args.ssl_keyfile = args.ssl_keyfile and os.path.abspath(args.ssl_keyfile)
    args.ssl_certfile = args.ssl_certfile and os.path.abspath(args.ssl_certfile)
    parse_api_keys(args.api_key)
    if args.api_key and args.api_key.startswith("@"):
        return "@" + os.path.abspath(args.api_key[1:])
    return args.api_key


def _print_event(event) -> None:
    if event.kind != "cluster_failed":  # the main loop says that one, as the error it exits with
        print(event.message, flush=True)


def _served_as(config) -> str:
    """The name clients send as ``model`` (the first served name), and the checkpoint it serves."""
    from pipeline.protocol.cluster import served_model_name, served_names

    name = served_names(config.model.served_model_name, served_model_name(config.model.model_path))[0]
    source = "the built-in model" if config.model.model_path is None else f"from {config.model.model_path}"
    return f"{name!r}, {source}"
