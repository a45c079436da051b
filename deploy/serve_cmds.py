"""``tandem router``, ``tandem prefill``, ``tandem decode`` and ``tandem worker --role``: one process each.

A worker binds itself to ``--cpu-cores`` and sets its torch threads (``--num-threads``) before anything
else starts a thread; the router only binds itself to ``--cpu-cores``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading

from deploy.config_flags import add_config_flags, config_from_args
from deploy.keygen_cmd import API_KEY_ENV, add_http_security_flags, add_security_flags, parse_api_keys
from deploy.router_preflight import check_router_can_start, port_number
from pipeline.config import PipelineRole
from pipeline.cpu_placement import allowed_cores, apply_cpu_placement, bind_to_cores, describe_placement

logger = logging.getLogger(__name__)

_ROLE_COMMANDS = {"prefill": PipelineRole.PrefillOnly, "decode": PipelineRole.DecodeOnly}


def register(sub) -> None:
    router = sub.add_parser("router", help="run the OpenAI-compatible HTTP router")
    router.add_argument("--host", default="127.0.0.1", help="address the HTTP API listens on (default 127.0.0.1)")
    router.add_argument("--port", type=port_number, default=8000, help="port of the HTTP API (default 8000)")
    add_http_security_flags(router, api_key_default=os.environ.get(API_KEY_ENV),
                            api_key_default_text="$TANDEM_API_KEY")
    add_config_flags(router, skip=("pipeline_role", "security"))  # a router has no role
    add_security_flags(router)
    router.set_defaults(handler=run_router_cmd)
    for name, role in _ROLE_COMMANDS.items():
        parser = sub.add_parser(name, help=f"run a {role.value} worker")
        _add_worker_flags(parser)
        parser.set_defaults(handler=run_worker_cmd, role=role.value)
    worker = sub.add_parser("worker", help="run a worker of any role")
    worker.add_argument("--role", required=True, choices=[r.value for r in PipelineRole],
                        help="what the worker does: prefill and decode (colocated), prefill only, or decode only")
    _add_worker_flags(worker)
    worker.set_defaults(handler=run_worker_cmd)


def _add_worker_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker-id", default=None, help="unique id (default: ROLE-HOST-PID)")
    add_config_flags(parser, skip=("pipeline_role", "security"))  # the subcommand (or --role) is the role
    add_security_flags(parser)


def run_router_cmd(args: argparse.Namespace) -> int:
    from router.app import run_router

    from pipeline.security import configure_cluster_security

    config = config_from_args(args)
    configure_cluster_security(config)  # a tcp:// cluster with no key stops here, before anything binds
    check_router_can_start(config.zmq_endpoint_base, args.host, args.port, args.ssl_keyfile, args.ssl_certfile)
    if config.cpu_cores is not None:  # the router binds only: it runs no torch
        bind_to_cores(allowed_cores(config.cpu_cores))
    run_router(config, host=args.host, port=args.port, api_key=parse_api_keys(args.api_key),
               model_path=config.model.model_path, ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
    return 0


def quiet_openmp_waits() -> None:
    """Let idle OpenMP threads sleep instead of spinning (unless the user chose a policy).

    Workers share a host's cores with each other (and with whatever else runs there); torch's OpenMP
    threads spin-wait between parallel regions by default, so a worker whose thread lost its core
    stalls every region of every other worker. Measured with `tandem up` on 2 cores (docs/load.md):
    1P1D median TTFT 5.7 s -> 0.10 s, colocated beside a busy loop 42 s -> 0.58 s. Read once, when
    torch loads its OpenMP runtime: call before the first torch import.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# the service.name of each role's spans (tandem-prefill, tandem-decode; a colocated worker decodes)
_TRACE_ROLES = {PipelineRole.PrefillOnly: "prefill", PipelineRole.DecodeOnly: "decode",
                PipelineRole.PrefillAndDecode: "decode"}


def run_worker_cmd(args: argparse.Namespace) -> int:
    quiet_openmp_waits()
    config = config_from_args(args, pipeline_role=args.role)
    from pipeline.security import configure_cluster_security

    configure_cluster_security(config)  # a tcp:// cluster with no key stops here, before anything binds
    worker_id = args.worker_id or f"{config.pipeline_role.value}-{socket.gethostname()}-{os.getpid()}"
    if config.tensor_parallel_size > 1:  # one thread, torch not run yet (as in the zygote): ranks 1..N-1 fork here
        from pipeline.parallel.rank_start import prefork_ranks

        prefork_ranks(config.tensor_parallel_size - 1)
    cores, num_threads = apply_cpu_placement(config)  # before any thread starts (and before torch's pool)
    ranks = f" (rank 0 of {config.tensor_parallel_size})" if config.tensor_parallel_size > 1 else ""
    logger.warning("worker %s placement%s: %s", worker_id, ranks, describe_placement(cores, num_threads))
    if config.pipeline_role is PipelineRole.PrefillOnly:
        from prefill_worker.worker import PrefillWorker as worker_cls
    else:
        from decode_worker.worker import DecodeWorker as worker_cls
    from pipeline import tracing

    tracing.configure(config.otlp_traces_endpoint, f"tandem-{_TRACE_ROLES[config.pipeline_role]}", worker_id)
    worker = worker_cls(config, worker_id)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logger.warning("worker %s (%s) serving; router at %s; listening on %s", worker_id, config.pipeline_role.value,
                   config.zmq_endpoint_base, ", ".join(worker.listen_endpoints()) or "no socket of its own")
    try:
        worker.run(stop)
    finally:
        tracing.shutdown()  # the spans still batched go out before the process ends
    return 0
