"""KV-aware routing on vs off, measured (``make bench-kv-routing``)::

    python -m bench.kv_routing_bench --out bench/results/kv_routing.json

For each cluster shape (2 colocated workers; 2 prefill + 2 decode) and each setting of
``router.kv_aware_routing``, a fresh cluster on the same cores and checkpoint serves:

* the multi-turn workload (``bench/serve_sessions.py``): TTFT per turn, prompt tokens the serving
  worker already held, KV bytes moved per turn and the routing-time prefix hit rates from /metrics;
* (colocated only) the random workload with no shared prefixes, for throughput: KV-aware routing must
  cost nothing when there is nothing to reuse.

The checkpoint is ``bench/serve_compare.py``'s (random weights, EOS unreachable). The report holds every
run and the ratios the targets are stated in (``comparisons``); a plot is written beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from dataclasses import asdict, replace
from pathlib import Path

import httpx

from bench import tandem_scrape
from bench.serve_sessions import SessionSpec, build_sessions, run_sessions, summarize_turns

SHAPES = {"2-colocated": (0, 0, 2), "2p2d": (2, 2, 0)}  # (prefill, decode, colocated)


def run_cluster(shape: str, kv_aware: bool, checkpoint: Path, cores: list[int], spec: SessionSpec,
                random_prompts: int, max_local_prefill_length: int | None = None,
                kv_overlap_weight: float | None = None, num_blocks: int | None = None,
                warm_prefill_cache: bool = True, early_prefill: bool = True) -> dict:
    from bench.peer_transformers import free_port
    from bench.serve import benchmark
    from bench.serve_client import ClientSettings
    from bench.serve_compare import client_on
    from bench.serve_workload import WorkloadSpec
    from deploy.cpu_plan import plan_cores, router_cores
    from deploy.local_launcher import LocalCluster
    from transformers import AutoTokenizer

    num_prefill, num_decode, num_colocated = SHAPES[shape]
    plan = plan_cores(cores, num_prefill, num_decode, num_colocated)
    config = {"router": {"kv_aware_routing": kv_aware, "warm_prefill_cache": warm_prefill_cache,
                         "early_prefill": early_prefill}}
    if max_local_prefill_length is not None:  # conditional disaggregation's threshold (the default otherwise)
        config["router"]["max_local_prefill_length"] = max_local_prefill_length
    if kv_overlap_weight is not None:
        config["router"]["kv_overlap_weight"] = kv_overlap_weight
    if num_blocks is not None:  # each worker's KV pool (default: cpu_kv_cache_gib's worth)
        config["kv_cache"] = {"num_blocks": num_blocks}
    cluster = LocalCluster(num_prefill=num_prefill, num_decode=num_decode, num_colocated=num_colocated,
                           model_path=str(checkpoint), port=free_port(), cpu_plan=plan,
                           router_cores=router_cores(plan), config=config)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    result: dict = {"shape": shape, "kv_aware_routing": kv_aware, "max_local_prefill_length": max_local_prefill_length,
                    "kv_overlap_weight": kv_overlap_weight, "num_blocks": num_blocks,
                    "warm_prefill_cache": warm_prefill_cache, "early_prefill": early_prefill}
    with cluster, client_on(router_cores(plan)):
        model = httpx.get(f"{cluster.url}/v1/models", timeout=10).json()["data"][0]["id"]
        # Steady state: the warm-up's conversations open with the service's system prompt (as the ones before
        # any measured conversation would), their messages are others.
        warm = build_sessions(replace(spec, num_sessions=2, num_turns=1, seed=spec.seed + 1000, system_seed=spec.seed),
                              len(tokenizer), set(tokenizer.all_special_ids))
        asyncio.run(run_sessions(cluster.url, model, spec, warm))
        before = tandem_scrape.wait_until_idle(cluster.url)
        sessions = build_sessions(spec, len(tokenizer), set(tokenizer.all_special_ids))
        outcomes, duration = asyncio.run(run_sessions(cluster.url, model, spec, sessions))
        result["multi_turn"] = summarize_turns(outcomes, duration)
        result["multi_turn"]["server"] = tandem_scrape.run_report(before, tandem_scrape.wait_until_idle(cluster.url),
                                                                  len(outcomes))
        if random_prompts and num_colocated:
            client = ClientSettings(base_url=cluster.url, endpoint="/v1/completions", model=model, ignore_eos=True)
            report = benchmark(client, WorkloadSpec(dataset="random", num_prompts=random_prompts, input_len=256,
                                                    output_len=64, seed=spec.seed), [float("inf")],
                               tokenizer=tokenizer, progress=False, label=f"{shape} kv={kv_aware}")
            run = report["runs"][0]
            result["random"] = {k: run[k] for k in ("completed", "failed", "request_throughput", "output_throughput",
                                                    "median_ttft_ms", "median_tpot_ms")}
    return result


def compare(runs: list[dict]) -> dict:
    by = {(r["shape"], r["kv_aware_routing"]): r for r in runs}
    out = {}
    for shape in SHAPES:
        on, off = by.get((shape, True)), by.get((shape, False))
        if on is None or off is None:
            continue
        entry = {"later_turns_p50_ttft_ratio_off_over_on": off["multi_turn"]["later_turns"]["median_ttft_ms"]
                 / on["multi_turn"]["later_turns"]["median_ttft_ms"],
                 "later_turns_cached_fraction": {"off": off["multi_turn"]["later_turns"]["cached_fraction"],
                                                 "on": on["multi_turn"]["later_turns"]["cached_fraction"]},
                 "later_turns_median_tpot_ms": {"off": off["multi_turn"]["later_turns"].get("median_tpot_ms"),
                                                "on": on["multi_turn"]["later_turns"].get("median_tpot_ms")}}
        entry["later_turns_that_missed_the_previous_turn"] = {  # the serving worker lacked its conversation
            setting: run["multi_turn"]["later_turns_missed_previous"]["count"] for setting, run in (("off", off), ("on", on))}
        entry["prompt_tokens_computed_per_turn"] = {
            setting: sum(run["multi_turn"]["server"]["prompt_tokens_computed_per_request"].values())
            for setting, run in (("off", off), ("on", on))}
        entry["warmup_tokens_computed_per_turn"] = {  # off the critical path, by prefill workers in idle steps
            setting: sum(run["multi_turn"]["server"].get("warmup_tokens_computed_per_request", {}).values())
            for setting, run in (("off", off), ("on", on))}
        bytes_off = off["multi_turn"]["server"]["kv_bytes_sent_per_request"]
        if bytes_off:
            entry["kv_bytes_per_turn_reduction"] = 1 - on["multi_turn"]["server"]["kv_bytes_sent_per_request"] / bytes_off
        if "random" in on and "random" in off:
            entry["random_throughput_ratio_on_over_off"] = (on["random"]["output_throughput"]
                                                            / off["random"]["output_throughput"])
        out[shape] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.serve_compare import benchmark_checkpoint, cpu_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv_routing.json"))
    parser.add_argument("--model-size", default="small")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=256)
    parser.add_argument("--user-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--session-rate", type=float, default=2.0)
    parser.add_argument("--think-time", type=float, default=0.5)
    parser.add_argument("--think-time-distribution", choices=["fixed", "exponential"], default="fixed",
                        help="every pause --think-time, or exponential draws with that mean")
    parser.add_argument("--random-prompts", type=int, default=64)
    parser.add_argument("--max-local-prefill-length", type=int, default=None,
                        help="router.max_local_prefill_length of every run (default: the config's, 32): with KV-aware "
                             "routing a turn whose uncached part is this short prefills on its decode worker")
    parser.add_argument("--kv-overlap-weight", type=float, default=None,
                        help="router.kv_overlap_weight of the KV-aware runs (default: the config's, 4.0)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV blocks per worker (default: kv_cache.cpu_kv_cache_gib's worth, far more than the "
                             "sessions need); fewer than the conversations' working set is where routing matters most")
    parser.add_argument("--routing", default="off,on", help="which settings of router.kv_aware_routing to run")
    parser.add_argument("--no-warm-prefill-cache", action="store_true",
                        help="router.warm_prefill_cache false: prefill workers recompute each turn's answer")
    parser.add_argument("--no-early-prefill", action="store_true",
                        help="router.early_prefill false: a prefill starts when the decode worker asks for it")
    args = parser.parse_args(argv)
    checkpoint = benchmark_checkpoint(args.model_size)
    cores = sorted(os.sched_getaffinity(0))
    spec = SessionSpec(num_sessions=args.sessions, num_turns=args.turns, system_len=args.system_len,
                       user_len=args.user_len, output_len=args.output_len, session_rate=args.session_rate,
                       think_time_s=args.think_time, think_time_distribution=args.think_time_distribution)
    runs = []
    for shape in args.shapes.split(","):
        for kv_aware in [setting == "on" for setting in args.routing.split(",")]:
            print(f"== {shape}, kv_aware_routing={kv_aware}", flush=True)
            runs.append(run_cluster(shape, kv_aware, checkpoint, cores, spec, args.random_prompts,
                                    args.max_local_prefill_length, args.kv_overlap_weight, args.num_blocks,
                                    warm_prefill_cache=not args.no_warm_prefill_cache,
                                    early_prefill=not args.no_early_prefill))
            print(json.dumps(runs[-1]["multi_turn"]["later_turns"]), runs[-1]["multi_turn"]["server"], flush=True)
    report = {"benchmark": "kv_routing", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu_model(),
              "cores": cores, "machine": platform.machine(), "checkpoint": str(checkpoint),
              "model_size": args.model_size, "sessions": asdict(spec),
              "max_local_prefill_length": args.max_local_prefill_length, "kv_overlap_weight": args.kv_overlap_weight,
              "num_blocks": args.num_blocks, "warm_prefill_cache": not args.no_warm_prefill_cache,
              "early_prefill": not args.no_early_prefill,
              "runs": runs, "comparisons": compare(runs)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report["comparisons"], indent=2))
    print(f"wrote {args.out}")
    print(f"wrote {plot(report, args.out.with_suffix('.png'))}")
    return 0


def plot(report: dict, out: Path) -> Path:
    """Median TTFT per turn index (one line per shape and setting) beside KV bytes moved per turn (P/D)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft_axis, bytes_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in report["runs"]:
        per_turn = run["multi_turn"]["per_turn"]
        turns = sorted(per_turn, key=int)
        label = f"{run['shape']}, kv-aware {'on' if run['kv_aware_routing'] else 'off'}"
        ttft_axis.plot([int(t) for t in turns], [per_turn[t]["median_ttft_ms"] for t in turns], marker="o",
                       linestyle="-" if run["kv_aware_routing"] else "--", label=label)
    ttft_axis.set(xlabel="turn", ylabel="median TTFT (ms)", title="TTFT per turn of a conversation")
    ttft_axis.legend(fontsize="small")
    pd_runs = [r for r in report["runs"] if r["multi_turn"]["server"]["kv_bytes_sent_per_request"]]
    bytes_axis.bar([f"{r['shape']}\nkv-aware {'on' if r['kv_aware_routing'] else 'off'}" for r in pd_runs],
                   [r["multi_turn"]["server"]["kv_bytes_sent_per_request"] / 1e6 for r in pd_runs])
    bytes_axis.set(ylabel="MB per turn", title="KV moved prefill -> decode per turn")
    fig.suptitle(f"KV-aware routing, multi-turn sessions ({report['sessions']['num_sessions']} x "
                 f"{report['sessions']['num_turns']} turns), {report['cpu']}", fontsize="medium")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
