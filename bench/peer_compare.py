"""Tandem against vLLM's CPU build, in one run, on the same checkpoint, cores and workloads (``make bench-peer``)::

    python -m bench.peer_compare --out bench/results/peer_compare.json

- **Setup**: vLLM goes into a virtualenv of its own (``bench/peer_vllm.py``), made on first use.
- **Offline**: both engines' ``LLM.generate`` on one seeded workload (48 prompts of 16-512 random
  tokens, 96 tokens out each, greedy, EOS ignored, prefix caching off), per dtype and thread count.
  Each engine runs in a process of its own (``bench/offline_runner.py``), pinned to the same cores,
  loaded once; repeats alternate which engine goes first, so both see the same neighbours. Tokens are
  compared between the engines.
- **Online**: ``vllm serve``, ``tandem up`` colocated and ``tandem up`` 1P1D on the same cores, each
  driven by the serving benchmark (``bench/serve.py``) with the same arrivals: the mixed workload
  (30 % 1500 -> 8 tokens, 70 % 32 -> 96), at a moderate rate and all at once (saturation).

The report has every repeat, the medians, the ratios the targets are stated in (``comparisons``), the
commands and the versions; plots are written beside it (``bench/peer_plot.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.peer_vllm import VLLM_VERSION, VllmServe, cpu_env, default_venv, installed_versions, setup_venv, venv_python
from bench.serve_compare import benchmark_checkpoint, client_on, cpu_model, run_tandem, write_comparison

RUNNER = Path(__file__).with_name("offline_runner.py")
ONLINE_SYSTEMS = ("vllm", "tandem-colocated", "tandem-1p1d")


# ------------------------------------------------------------------------------------------ offline
def offline_workload(args, vocab_size: int, special_ids: set[int]) -> dict:
    rng = random.Random(args.seed)
    ordinary = [t for t in range(vocab_size) if t not in special_ids]
    prompts = [[rng.choice(ordinary) for _ in range(rng.randint(args.min_prompt_len, args.max_prompt_len))]
               for _ in range(args.num_prompts)]
    return {"prompt_token_ids": prompts, "max_tokens": [args.output_len] * args.num_prompts}


class OfflineRunner:
    """One engine in its own process (``bench/offline_runner.py``), loaded once, timed on request."""

    def __init__(self, engine: str, python: Path, model: Path, dtype: str, cores: list[int], warmup: Path,
                 log: Path, kv_cache_gib: float):
        self.engine = engine
        cores_text = ",".join(map(str, cores))
        self.command = ["taskset", "-c", cores_text, str(python), str(RUNNER), "--engine", engine, "--model",
                        str(model), "--dtype", dtype, "--warmup", str(warmup), "--threads", str(len(cores)),
                        "--kv-cache-gib", str(kv_cache_gib)]
        env = {**os.environ, "OMP_NUM_THREADS": str(len(cores)), "TOKENIZERS_PARALLELISM": "false"}
        if engine == "vllm":
            env.update(cpu_env(cores, kv_cache_gib))
            env["PYTHONPATH"] = ""  # nothing of Tandem on its path
        self._log = open(log, "ab")
        self.process = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self._log, env=env, text=True, start_new_session=True)
        self.versions = self._read()["versions"]

    def _read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"the {self.engine} runner exited ({self.process.wait()}); see {self._log.name}")

    def run(self, workload: Path) -> dict:
        self.process.stdin.write(json.dumps({"cmd": "run", "workload": str(workload)}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.process.stdin.close()
            self.process.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        self._log.close()


def run_offline(args, venv: Path, checkpoint: Path, cores: list[int], scratch: Path) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    workload = offline_workload(args, len(tokenizer), set(tokenizer.all_special_ids))
    workload_path, warmup_path = scratch / "workload.json", scratch / "warmup.json"
    workload_path.write_text(json.dumps(workload))
    warmup_path.write_text(json.dumps({k: v[:4] for k, v in workload.items()}))
    pythons = {"tandem": Path(sys.executable), "vllm": venv_python(venv)}
    configs = []
    for dtype in args.dtypes.split(","):
        for threads in (int(t) for t in args.threads.split(",")):
            used = cores[:threads]
            runners = {engine: OfflineRunner(engine, pythons[engine], checkpoint, dtype, used, warmup_path,
                                             args.log_dir / f"offline-{engine}-{dtype}-{threads}t.log", args.kv_cache_gib)
                       for engine in ("tandem", "vllm")}
            runs: dict[str, list[dict]] = {"tandem": [], "vllm": []}
            tokens: dict[str, list] = {}
            try:
                for repeat in range(args.repeats):
                    for engine in (("tandem", "vllm") if repeat % 2 == 0 else ("vllm", "tandem")):
                        reply = runners[engine].run(workload_path)
                        tokens[engine] = reply.pop("token_ids")
                        reply["output_tokens_per_s"] = reply["output_tokens"] / reply["wall_s"]
                        reply["loadavg_1min"] = os.getloadavg()[0]
                        runs[engine].append(reply)
                        print(f"offline {dtype} {threads}t repeat {repeat}: {engine:>6} {reply['wall_s']:6.2f} s "
                              f"{reply['output_tokens_per_s']:7.1f} tok/s", flush=True)
                versions = {engine: runner.versions for engine, runner in runners.items()}
            finally:
                for runner in runners.values():
                    runner.close()
            medians = {e: statistics.median(r["output_tokens_per_s"] for r in runs[e]) for e in runs}
            configs.append({
                "dtype": dtype, "threads": threads, "cores": used, "runs": runs, "versions": versions,
                "median_output_tokens_per_s": medians,
                "ratio_tandem_over_vllm": medians["tandem"] / medians["vllm"],
                "ratio_per_repeat": [t["output_tokens_per_s"] / v["output_tokens_per_s"]
                                     for t, v in zip(runs["tandem"], runs["vllm"])],
                "requests_token_identical": sum(a == b for a, b in zip(tokens["tandem"], tokens["vllm"])),
                "num_requests": len(workload["max_tokens"]),
                "commands": {e: " ".join(r.command) for e, r in runners.items()},
            })
    return {"workload": {"num_prompts": args.num_prompts, "prompt_len": [args.min_prompt_len, args.max_prompt_len],
                         "output_len": args.output_len, "seed": args.seed,
                         "total_prompt_tokens": sum(map(len, workload["prompt_token_ids"])),
                         "sampling": "greedy, ignore_eos, prefix caching off"},
            "settings": {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "max_model_len": 2048,
                         "kv_cache_gib": args.kv_cache_gib},
            "configs": configs}


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
            server = VllmServe(venv, checkpoint, cores=cores, kv_cache_gib=args.kv_cache_gib,
                               log_path=args.log_dir / "online-vllm.log")
            with server, client_on(cores):
                reports[name] = run(name)(server.url, server.model_name)
            commands[name] = " ".join(server.command)
        else:
            reports[name], commands[name] = run_tandem(name, checkpoint, cores, run(name))
        print(f"online {name}: done in {time.monotonic() - started:.0f} s", flush=True)
    return {"workload": {"dataset": "mixed", "num_prompts": spec.num_prompts, "long": "30 % 1500 -> 8",
                         "short": "70 % 32 -> 96", "rates": rates, "ignore_eos": True},
            "systems": reports, "commands": commands}


def _at_rate(report: dict, rate: float) -> dict:
    return next(r for r in report["runs"] if r["request_rate"] == rate)


def compare(result: dict) -> dict:
    """The numbers issue 20's targets are stated in."""
    out: dict = {}
    for config in result.get("offline", {}).get("configs", []):
        out[f"offline_{config['dtype']}_{config['threads']}t_tandem_over_vllm"] = config["ratio_tandem_over_vllm"]
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
        for name in ("tandem-1p1d", "tandem-colocated"):
            if name in online:
                mine = _at_rate(online[name], moderate)
                out[f"online_moderate_tpot_{name}"] = {
                    "rate": moderate, "p50_tpot_ms": {name: mine["median_tpot_ms"], "vllm": peer_mid["median_tpot_ms"]},
                    "p99_tpot_ms": {name: mine["p99_tpot_ms"], "vllm": peer_mid["p99_tpot_ms"]},
                    "p50_ratio_vllm_over_tandem": peer_mid["median_tpot_ms"] / max(mine["median_tpot_ms"], 1e-9),
                    "p99_ratio_vllm_over_tandem": peer_mid["p99_tpot_ms"] / max(mine["p99_tpot_ms"], 1e-9)}
        out["failed"] = {name: sum(r["failed"] for r in rep["runs"]) for name, rep in online.items()}
    out["targets"] = {"offline_fp32_tandem_over_vllm": 1.0, "online_saturation_ratio": 1.0,
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
    parser.add_argument("--model-size", default="medium", choices=["small", "medium"])
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-online", action="store_true")
    offline = parser.add_argument_group("offline")
    offline.add_argument("--dtypes", default="float32,bfloat16")
    offline.add_argument("--threads", default="1,2", help="comma list of thread counts (first N of --cores)")
    offline.add_argument("--repeats", type=int, default=3)
    offline.add_argument("--num-prompts", type=int, default=48)
    offline.add_argument("--min-prompt-len", type=int, default=16)
    offline.add_argument("--max-prompt-len", type=int, default=512)
    offline.add_argument("--output-len", type=int, default=96)
    offline.add_argument("--kv-cache-gib", type=int, default=2, help="KV pool of each system (GiB)")
    online = parser.add_argument_group("online")
    online.add_argument("--online-systems", default=",".join(ONLINE_SYSTEMS))
    online.add_argument("--online-rates", default="1.5,inf", help="the lowest is the moderate rate, the highest saturation")
    online.add_argument("--online-num-prompts", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=None, help="engines' and servers' logs (default: a temp dir)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    from pipeline.core_list import parse_core_list

    venv = setup_venv(args.venv, args.vllm_version)
    if args.setup_only:
        print(f"vLLM's virtualenv: {venv} ({installed_versions(venv)})")
        return 0
    cores = parse_core_list(args.cores) if args.cores else sorted(os.sched_getaffinity(0))
    checkpoint = benchmark_checkpoint(args.model_size)
    scratch = Path(tempfile.mkdtemp(prefix="peer-compare-"))
    args.log_dir = Path(args.log_dir or scratch)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers

    result: dict = {
        "benchmark": "peer_compare", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cores": cores,
        "checkpoint": {"size": args.model_size, "path": str(checkpoint)},
        "bench_command": " ".join(["python -m bench.peer_compare", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"cpu": cpu_model(), "cores_online": os.cpu_count()},
        "versions": {"vllm_venv": installed_versions(venv),
                     "tandem_venv": {"torch": torch.__version__, "transformers": transformers.__version__}},
        "log_dir": str(args.log_dir),
    }
    if not args.skip_offline:
        result["offline"] = run_offline(args, venv, checkpoint, cores, scratch)
    if not args.skip_online:
        result["online"] = run_online(args, venv, checkpoint, cores)
    result["loadavg_1min_after"] = os.getloadavg()[0]
    result["comparisons"] = compare(result)
    from bench.peer_plot import render_peer

    write_comparison(result, args.out, render_peer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
