"""The command line of ``tandem bench serve`` (``bench/serve.py``), kept apart so that building the
``tandem`` parser, which every router and worker process does, imports nothing of the benchmark."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000")
    server.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    server.add_argument("--model", default=None, help="the request's model (default: the server's first model)")
    server.add_argument("--tokenizer", default=None,
                        help="tokenizer directory (default: the model if it is a directory, else its /v1/models root)")
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    server.add_argument("--label", default=None, help="name of the system under test, for the report")
    work = parser.add_argument_group("workload")
    work.add_argument("--dataset", default="random", choices=["random", "mixed", "multi-turn"],
                      help="multi-turn: growing conversations (bench/serve_sessions.py), TTFT per turn")
    work.add_argument("--num-prompts", type=int, default=100)
    work.add_argument("--random-input-len", type=int, default=128)
    work.add_argument("--random-output-len", type=int, default=128)
    add_mixed_arguments(work)
    turns = parser.add_argument_group("multi-turn workload")
    turns.add_argument("--multi-turn-sessions", type=int, default=16)
    turns.add_argument("--multi-turn-turns", type=int, default=4)
    turns.add_argument("--multi-turn-system-len", type=int, default=256, help="system prompt shared by all sessions")
    turns.add_argument("--multi-turn-user-len", type=int, default=64, help="tokens of each turn's new message")
    turns.add_argument("--multi-turn-output-len", type=int, default=32, help="tokens of each answer")
    turns.add_argument("--multi-turn-session-rate", type=float, default=1.0, help="sessions started per second")
    turns.add_argument("--multi-turn-think-time", type=float, default=1.0, help="seconds between answer and next turn")
    turns.add_argument("--multi-turn-think-time-distribution", choices=["fixed", "exponential"], default="fixed",
                       help="every pause the think time, or exponential draws with that mean")
    work.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (a vLLM/Tandem extension)")
    work.add_argument("--seed", type=int, default=0)
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", "--rate", default="inf",
                      help="requests/s; a comma list runs a sweep (default inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--num-warmups", type=int, default=2, help="requests sent before the measurement")
    load.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                      help="SLOs for request_goodput, e.g. ttft:2000 tpot:100 (names: ttft, tpot, e2el)")
    load.add_argument("--attainment-target", type=float, default=0.9,
                      help="goodput_rate: the highest rate whose SLO attainment reaches this (default 0.9)")
    out = parser.add_argument_group("output")
    out.add_argument("--out", type=Path, default=None, help="JSON report (PNG plots are written beside it)")
    out.add_argument("--no-plot", action="store_true")
    out.add_argument("--no-progress", action="store_true")


def add_mixed_arguments(group) -> None:
    """The ``mixed`` workload's shape (also ``bench/serve_compare.py``'s)."""
    group.add_argument("--mixed-long-fraction", type=float, default=0.2, help="share of long requests")
    group.add_argument("--mixed-long-input-len", type=int, default=1536)
    group.add_argument("--mixed-long-output-len", type=int, default=8)
    group.add_argument("--mixed-short-input-len", type=int, default=64)
    group.add_argument("--mixed-short-output-len", type=int, default=128)


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--request-rate takes numbers or inf, comma-separated (got {text!r})") from None
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--request-rate: every rate must be > 0 (got {text!r})")
    return rates
