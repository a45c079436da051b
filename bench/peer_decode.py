"""Batch-1 decode against the memory-bandwidth bound, for ``bench/peer_compare.py``.

One request of ``prompt_len`` random tokens is run twice per engine and repeat: with ``max_tokens`` 1 (prefill
and the first token) and with ``1 + num_tokens``; the difference over ``num_tokens`` is one decode step's time,
free of prefill and of the engine's per-request costs. The bound is the time a step needs to read every weight
once at the bandwidth measured after each repeat (``bench/memory_bandwidth.py``; the median over repeats),
so the bound sees the same neighbours as the engines; the KV cache of a short prompt (a few MiB) is left out.
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path


def write_workloads(scratch: Path, vocab_size: int, special_ids: set[int], prompt_len: int, num_tokens: int,
                    seed: int) -> tuple[Path, Path]:
    rng = random.Random(seed + 1)
    ordinary = [t for t in range(vocab_size) if t not in special_ids]
    prompt = [rng.choice(ordinary) for _ in range(prompt_len)]
    paths = []
    for max_tokens in (1, 1 + num_tokens):
        path = scratch / f"decode-{max_tokens}.json"
        path.write_text(json.dumps({"prompt_token_ids": [prompt], "max_tokens": [max_tokens]}))
        paths.append(path)
    return paths[0], paths[1]


def measure(runners: dict, workloads: tuple[Path, Path], num_tokens: int, repeats: int, threads: int) -> dict:
    """ms per decode step of each engine, every repeat (engines alternate which goes first), and the memory
    bandwidth measured in each repeat too, so the bound sees the same neighbours as the engines."""
    from bench import memory_bandwidth

    step_ms: dict[str, list[float]] = {engine: [] for engine in runners}
    bandwidths = []
    first, full = workloads
    for runner in runners.values():  # batch-1 shapes are new to both engines: their first run is not timed
        runner.run(first), runner.run(full)
    for repeat in range(repeats):
        order = list(runners) if repeat % 2 == 0 else list(runners)[::-1]
        for engine in order:
            short = runners[engine].run(first)["wall_s"]
            long = runners[engine].run(full)["wall_s"]
            step_ms[engine].append((long - short) / num_tokens * 1e3)
            print(f"batch-1 decode repeat {repeat}: {engine:>6} {step_ms[engine][-1]:6.1f} ms/token", flush=True)
        bandwidths.append(memory_bandwidth.measure(threads, repeats=5))
    bandwidth = {kind: {"median_gb_s": statistics.median(b[kind]["median_gb_s"] for b in bandwidths),
                        "per_repeat_gb_s": [b[kind]["median_gb_s"] for b in bandwidths]} for kind in ("copy", "read")}
    return {"num_tokens": num_tokens, "step_ms": step_ms, "bandwidth_during": bandwidth,
            "median_step_ms": {e: statistics.median(v) for e, v in step_ms.items()}}


def against_bound(decode: dict, weight_bytes: int, bandwidth: dict) -> dict:
    """The bound (ms per token at the copy and at the read bandwidth) and each engine's fraction of it."""
    out = {"weight_bytes_per_token": weight_bytes}
    for kind in ("copy", "read"):
        gb_s = bandwidth[kind]["median_gb_s"]
        bound_ms = weight_bytes / (gb_s * 1e9) * 1e3
        out[f"bound_ms_at_{kind}"] = bound_ms
        out[f"fraction_of_{kind}_bound"] = {e: bound_ms / ms for e, ms in decode["median_step_ms"].items()}
    return out
