"""Tandem against vLLM's CPU build, in one run, on the same checkpoint, cores and workloads (``make bench-peer``)::

    python -m bench.peer_compare --out bench/results/peer_compare.json

- **Setup**: vLLM goes into a virtualenv of its own (``bench/peer_vllm.py``), made on first use.
- **Offline**: both engines' ``LLM.generate`` on one seeded workload (48 prompts of 16-512 random
  tokens, 96 tokens out each, greedy, EOS ignored, prefix caching off), per dtype and thread count.
  Each engine runs in a process of its own, pinned to the same cores, loaded once, repeats alternating
  (``bench/peer_offline.py``). Tokens are compared between the engines. ``--model-size`` / ``--configs``
  pick the checkpoints: the small and medium random Llamas, the TinyLlama-1.1B and Llama-3.2-3B shapes
  (random bf16 weights built locally, ``bench/peer_checkpoints.py``; smaller workloads, ``LARGE_WORKLOADS``), the
  other families' shapes built by transformers' own classes (``BUILT_SHAPES``: Qwen3-MoE, Gemma 3 1B, four of
  gpt-oss-20b's layers, DeepSeek-V2-Lite's size in four layers), and dtype ``int8``: the same model as a
  compressed-tensors W8A8 checkpoint that both engines load (activations in bf16).
- **The physical limit**: the machine's memory bandwidth (``bench/memory_bandwidth.py``) per thread count, and on
  the bf16 configs of ``--decode-latency`` sizes each engine's batch-1 decode step against weight bytes /
  bandwidth (``bench/peer_decode.py``).
- **Online**: ``vllm serve``, ``tandem up`` colocated, ``tandem up`` 1P1D, and 1P1D whose decode worker takes
  prompts from a long prefill queue (``router.prefill_spill_tokens``, docs/load.md) on the same cores, each
  driven by the serving benchmark (``bench/serve.py``) with the same arrivals: the mixed workload (30 % 1500 -> 8
  tokens, 70 % 32 -> 96), at a moderate rate and all at once (saturation).

The report has every repeat, the medians, the ratios the targets are stated in (``comparisons``), the
commands and the versions; plots are written beside it (``bench/peer_plot.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.peer_checkpoints import BUILT_SHAPES, LARGE_SHAPES, peer_checkpoint
from bench.peer_offline import LARGE_WORKLOADS, parse_configs, run_offline
from bench.peer_vllm import VLLM_VERSION, VllmServe, default_venv, installed_versions, setup_venv
from bench.serve_compare import client_on, cpu_model, run_tandem, write_comparison

ONLINE_SYSTEMS = ("vllm", "tandem-colocated", "tandem-1p1d", "tandem-1p1d-spill")
MODEL_SIZES = ("small", "medium", *LARGE_SHAPES, *BUILT_SHAPES)


def cpu_flags() -> list[str]:
    """The flags ``lscpu`` reports (``/proc/cpuinfo``) that decide which kernels run: SIMD, bf16, int8, AMX."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma", "sse4")))
    return []


# ------------------------------------------------------------------------------------------- online
def run_online(args, venv: Path, checkpoint: Path, cores: list[int]) -> dict:
    from transformers import AutoTokenizer

    from bench.serve import benchmark
    from bench.serve_client import ClientSettings
    from bench.serve_cli import parse_rates
    from bench.serve_workload import WorkloadSpec

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    spec = WorkloadSpec(dataset="mixed", num_prompts=args.online_num_prompts, long_fraction=0.3, long_input_len=1500,
                        long_output_len=8, short_input_len=32, short_output_len=96, seed=args.seed)
    rates = parse_rates(args.online_rates)

    def run(label: str):
        def measure(url: str, model: str) -> dict:
            client = ClientSettings(base_url=url, endpoint="/v1/completions", model=model, ignore_eos=True)
            return benchmark(client, spec, rates, tokenizer=tokenizer, progress=not args.no_progress, label=label)
        return measure

    reports, commands = {}, {}
    for name in args.online_systems.split(","):
        started = time.monotonic()
        if name == "vllm":
            server = VllmServe(venv, checkpoint, cores=cores, dtype=args.online_dtype, kv_cache_gib=args.kv_cache_gib,
                               log_path=args.log_dir / "online-vllm.log")
            with server, client_on(cores):
                reports[name] = run(name)(server.url, server.model_name)
            commands[name] = " ".join(server.command)
        else:
            reports[name], commands[name] = run_tandem(name, checkpoint, cores, run(name), args.online_dtype)
        print(f"online {name}: done in {time.monotonic() - started:.0f} s", flush=True)
    return {"dtype": args.online_dtype,
            "workload": {"dataset": "mixed", "num_prompts": spec.num_prompts, "long": "30 % 1500 -> 8",
                         "short": "70 % 32 -> 96", "rates": rates, "ignore_eos": True},
            "systems": reports, "commands": commands}


def _at_rate(report: dict, rate: float) -> dict:
    return next(r for r in report["runs"] if r["request_rate"] == rate)


def compare(result: dict) -> dict:
    """The numbers issue 20's targets are stated in."""
    out: dict = {}
    for config in result.get("offline", {}).get("configs", []):
        key = f"offline_{config.get('model_size', '')}_{config['dtype']}_{config['threads']}t"
        out[f"{key}_tandem_over_vllm"] = config["ratio_tandem_over_vllm"]
        if config.get("peak_rss_gib"):
            out[f"{key}_peak_rss_gib"] = config["peak_rss_gib"]
        if config.get("batch1_decode"):
            decode = config["batch1_decode"]
            out[f"{key}_batch1_decode"] = {"median_step_ms": decode["median_step_ms"],
                                           "bound_ms_at_copy": decode["bound_ms_at_copy"],
                                           "fraction_of_copy_bound": decode["fraction_of_copy_bound"],
                                           "fraction_of_read_bound": decode["fraction_of_read_bound"]}
    online = result.get("online", {}).get("systems", {})
    if "vllm" in online:
        rates = [r["request_rate"] for r in online["vllm"]["runs"]]
        top, moderate = max(rates), min(rates)
        peer_top, peer_mid = _at_rate(online["vllm"], top), _at_rate(online["vllm"], moderate)
        if "tandem-colocated" in online:
            colo = _at_rate(online["tandem-colocated"], top)
            out["online_saturation_output_throughput"] = {
                "rate": top, "tandem-colocated": colo["output_throughput"], "vllm": peer_top["output_throughput"],
                "ratio": colo["output_throughput"] / max(peer_top["output_throughput"], 1e-9)}
        for name in ("tandem-1p1d", "tandem-1p1d-spill"):
            if name in online:
                mine = _at_rate(online[name], top)
                out[f"online_saturation_{name}"] = {
                    "rate": top,
                    "output_throughput_ratio": mine["output_throughput"] / max(peer_top["output_throughput"], 1e-9),
                    "p99_tpot_ratio_vllm_over_tandem": peer_top["p99_tpot_ms"] / max(mine["p99_tpot_ms"], 1e-9)}
        for name in ("tandem-1p1d", "tandem-1p1d-spill", "tandem-colocated"):
            if name in online:
                mine = _at_rate(online[name], moderate)
                out[f"online_moderate_tpot_{name}"] = {
                    "rate": moderate, "p50_tpot_ms": {name: mine["median_tpot_ms"], "vllm": peer_mid["median_tpot_ms"]},
                    "p99_tpot_ms": {name: mine["p99_tpot_ms"], "vllm": peer_mid["p99_tpot_ms"]},
                    "p50_ratio_vllm_over_tandem": peer_mid["median_tpot_ms"] / max(mine["median_tpot_ms"], 1e-9),
                    "p99_ratio_vllm_over_tandem": peer_mid["p99_tpot_ms"] / max(mine["p99_tpot_ms"], 1e-9)}
        out["failed"] = {name: sum(r["failed"] for r in rep["runs"]) for name, rep in online.items()}
    out["targets"] = {"offline_tandem_over_vllm (issue 34)": 1.2, "batch1_bf16_decode_fraction_of_bound": 0.7,
                      "offline_fp32_tandem_over_vllm": 1.0, "online_saturation_ratio": 1.0,
                      "online_moderate_1p1d_p50_ratio_vllm_over_tandem": 1.0,
                      "online_moderate_1p1d_p99_ratio_vllm_over_tandem": 2.0}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/peer_compare.json"))
    parser.add_argument("--venv", type=Path, default=None, help=f"vLLM's virtualenv (default {default_venv()})")
    parser.add_argument("--vllm-version", default=VLLM_VERSION)
    parser.add_argument("--setup-only", action="store_true", help="make vLLM's virtualenv and stop")
    parser.add_argument("--cores", default=None, help="cores both systems get, e.g. 0-1 (default: all of ours)")
    parser.add_argument("--model-size", default="medium",
                        help=f"comma list of {', '.join(MODEL_SIZES)} (offline: each x --dtypes x --threads; online: the first)")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-online", action="store_true")
    offline = parser.add_argument_group("offline")
    offline.add_argument("--dtypes", default="float32,bfloat16")
    offline.add_argument("--threads", default="1,2", help="comma list of thread counts (first N of --cores)")
    offline.add_argument("--configs", default=None,
                         help="SIZE:DTYPE:THREADS,... instead of sizes x dtypes x threads; DTYPE int8 = the W8A8 checkpoint")
    offline.add_argument("--no-large-workloads", action="store_true",
                         help=f"the large shapes run the command line's workload too, not {LARGE_WORKLOADS}")
    offline.add_argument("--decode-latency", default="1.1b",
                         help="sizes whose bfloat16 configs also time batch-1 decode against the bandwidth bound")
    offline.add_argument("--decode-prompt-len", type=int, default=16)
    offline.add_argument("--decode-tokens", type=int, default=32)
    offline.add_argument("--repeats", type=int, default=3)
    offline.add_argument("--one-engine-at-a-time", action="store_true",
                         help="load one engine, run its repeats, close it, then the other (for a model whose two "
                              "engines do not fit in memory together; the repeats no longer alternate, and the "
                              "batch-1 decode timing, which needs both at once, is skipped)")
    offline.add_argument("--num-prompts", type=int, default=48)
    offline.add_argument("--min-prompt-len", type=int, default=16)
    offline.add_argument("--max-prompt-len", type=int, default=512)
    offline.add_argument("--output-len", type=int, default=96)
    offline.add_argument("--kv-cache-gib", type=int, default=2, help="KV pool of each system (GiB)")
    online = parser.add_argument_group("online")
    online.add_argument("--online-systems", default=",".join(ONLINE_SYSTEMS))
    online.add_argument("--online-rates", default="1.5,inf", help="the lowest is the moderate rate, the highest saturation")
    online.add_argument("--online-num-prompts", type=int, default=40)
    online.add_argument("--online-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="both servers' weights and KV cache (the checkpoint is fp32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=None, help="engines' and servers' logs (default: a temp dir)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    from pipeline.core_list import parse_core_list

    venv = setup_venv(args.venv, args.vllm_version)
    if args.setup_only:
        print(f"vLLM's virtualenv: {venv} ({installed_versions(venv)})")
        return 0
    for size in {s for s, _, _ in parse_configs(args)} | set(args.model_size.split(",")):
        if size not in MODEL_SIZES:
            parser.error(f"unknown model size {size!r} (one of {', '.join(MODEL_SIZES)})")
    cores = parse_core_list(args.cores) if args.cores else sorted(os.sched_getaffinity(0))
    scratch = Path(tempfile.mkdtemp(prefix="peer-compare-"))
    args.log_dir = Path(args.log_dir or scratch)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers

    result: dict = {
        "benchmark": "peer_compare", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cores": cores,
        "model_sizes": {s: LARGE_SHAPES.get(s) or BUILT_SHAPES.get(s, s) for s in sorted({c[0] for c in parse_configs(args)})},
        "bench_command": " ".join(["python -m bench.peer_compare", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"cpu": cpu_model(), "cores_online": os.cpu_count(), "cpu_flags": cpu_flags(),
                    "loadavg_1min_before": os.getloadavg()[0]},
        "versions": {"vllm_venv": installed_versions(venv),
                     "tandem_venv": {"torch": torch.__version__, "transformers": transformers.__version__}},
        "log_dir": str(args.log_dir),
    }
    if not args.skip_offline:
        result["offline"] = run_offline(args, venv, cores, scratch)
    if not args.skip_online:
        checkpoint = peer_checkpoint(args.model_size.split(",")[0])
        result["checkpoint_online"] = str(checkpoint)
        result["online"] = run_online(args, venv, checkpoint, cores)
    result["loadavg_1min_after"] = os.getloadavg()[0]
    result["comparisons"] = compare(result)
    from bench.peer_plot import render_peer

    write_comparison(result, args.out, render_peer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
