"""``tandem up``: a whole local cluster (router + workers as separate processes) until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from deploy.config_flags import add_config_flags, config_from_args
from pipeline.config import PipelineConfig


def register(sub) -> None:
    parser = sub.add_parser("up", help="start a local cluster: router, prefill and decode workers")
    parser.add_argument("--prefill", type=int, default=None, help="PrefillOnly workers (default 1)")
    parser.add_argument("--decode", type=int, default=None, help="DecodeOnly workers (default 1)")
    parser.add_argument("--colocated", type=int, default=0, help="PrefillAndDecode workers (default 0)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--log-dir", default=None, help="where each process logs (default: a temp dir)")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    add_config_flags(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from deploy.local_launcher import ClusterError, LocalCluster

    if args.prefill is None and args.decode is None:
        args.prefill, args.decode = (1, 1) if not args.colocated else (0, 0)
    config = config_from_args(args)  # validates every flag and the file section before anything starts
    if config.model.model_path is not None:  # a broken checkpoint is one clear error, not three crashed processes
        from pipeline.weights import load_hf_config, weight_files

        load_hf_config(config.model.model_path)
        weight_files(config.model.model_path)
    overrides = config.model_dump(mode="json", exclude={"config_file", "section_name", "pipeline_role"},
                                  exclude_unset=False)
    if config.zmq_endpoint_base == PipelineConfig.model_fields["zmq_endpoint_base"].default:
        overrides.pop("zmq_endpoint_base")  # not chosen by the user: a fresh ipc path per cluster
    cluster = LocalCluster(
        num_prefill=args.prefill or 0, num_decode=args.decode or 0, num_colocated=args.colocated,
        host=args.host, port=args.port, config=overrides, api_key=args.api_key, log_dir=args.log_dir,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if config.model.model_path is None:
        from pipeline.builtin_model import BUILTIN_NOTICE

        print(BUILTIN_NOTICE, flush=True)
    print(f"starting {len(cluster.worker_names)} workers and the router; logs in {cluster.log_dir}", flush=True)
    try:
        try:
            cluster.start(timeout_s=args.ready_timeout)
        except ClusterError as exc:
            print(f"tandem up: error: {exc}", file=sys.stderr, flush=True)
            return 1
        print(f"Tandem is ready at {cluster.url}/v1 (model: {config.model.model_path or 'built-in'}); "
              "Ctrl-C to stop", flush=True)
        while not stop.wait(1.0):
            for name, proc in cluster.processes.items():
                if proc.poll() is not None:
                    print(f"{name} exited with code {proc.returncode}; see {cluster.log_dir}/{name}.log", flush=True)
                    stop.set()
    finally:
        print("shutting down...", flush=True)
        cluster.stop()
    return 0
