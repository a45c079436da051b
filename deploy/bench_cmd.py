"""``tandem bench serve``: the serving benchmark (``bench/serve.py``) against any OpenAI-compatible endpoint."""

from __future__ import annotations

import argparse

from bench.serve_cli import add_arguments  # the flags only: the benchmark itself loads when it runs


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    serve = kinds.add_parser("serve", help="serving benchmark: latency, throughput and goodput under open-loop load",
                             description="Serving benchmark (vLLM bench serve conventions); see bench/serve.py.")
    add_arguments(serve)
    serve.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import httpx

    from bench.serve import run_from_args

    try:
        return run_from_args(args)
    except httpx.HTTPError as exc:  # the server is down or refused us: a message, not a traceback
        raise ValueError(f"{args.base_url}: {exc!r}") from None
