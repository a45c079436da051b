"""The offline half of ``bench/peer_compare.py``: each engine's ``LLM.generate`` in a process of its own
(``bench/offline_runner.py``), on one seeded workload per model size, dtype and thread count.

Both engines are loaded once, pinned to the same cores; repeats alternate which goes first, so both see the same
neighbours, and each run starts once the other engine's processes are idle (``OfflineRunner.settle``).
``--one-engine-at-a-time`` instead loads one, runs its repeats and closes it before the other (a model whose two
engines do not fit in memory together). Tokens are compared between the engines.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import memory_bandwidth, peer_decode
from bench.peer_checkpoints import peer_checkpoint, weight_bytes_per_token
from bench.peer_vllm import cpu_env, venv_python

RUNNER = Path(__file__).with_name("offline_runner.py")
# The large shapes' offline workload, sized so a repeat takes well under a minute on 2 cores
LARGE_WORKLOADS = {"1.1b": dict(num_prompts=12, min_prompt_len=16, max_prompt_len=256, output_len=32),
                   "3b": dict(num_prompts=8, min_prompt_len=16, max_prompt_len=128, output_len=16),
                   "8b": dict(num_prompts=8, min_prompt_len=16, max_prompt_len=128, output_len=16),
                   "gemma3-1b": dict(num_prompts=12, min_prompt_len=16, max_prompt_len=256, output_len=32),
                   "gpt-oss-20b-4l": dict(num_prompts=12, min_prompt_len=16, max_prompt_len=256, output_len=32),
                   "deepseek-v2-lite-4l": dict(num_prompts=12, min_prompt_len=16, max_prompt_len=256, output_len=32)}


def offline_workload(args, vocab_size: int, special_ids: set[int]) -> dict:
    rng = random.Random(args.seed)
    ordinary = [t for t in range(vocab_size) if t not in special_ids]
    prompts = [[rng.choice(ordinary) for _ in range(rng.randint(args.min_prompt_len, args.max_prompt_len))]
               for _ in range(args.num_prompts)]
    return {"prompt_token_ids": prompts, "max_tokens": [args.output_len] * args.num_prompts}


def _process_tree(pid: int) -> list[Path]:
    """``/proc/<pid>/task/<tid>`` of ``pid`` and of every process under it, every thread."""
    tasks, pending = [], [pid]
    while pending:
        current = pending.pop()
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                tasks.append(task)
                children = task / "children"
                if children.is_file():
                    pending.extend(int(c) for c in children.read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return tasks


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of ``pid`` and every process under it, every thread."""
    total = 0
    for task in _process_tree(pid):
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _peak_rss_gib(pid: int) -> float:
    """The peak resident memory (``VmHWM``) of ``pid`` and every process under it, summed: an engine whose
    model runs in a child process (vLLM's engine core) counts it too."""
    total_kib = 0
    for process in {task.parent.parent for task in _process_tree(pid)}:
        try:
            status = (process / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        total_kib += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
    return total_kib / 2**20


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
        self.peak_rss_gib: float | None = None  # set when closed
        self.settle()  # its warm-up leaves the same tail as a run

    def _read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"the {self.engine} runner exited ({self.process.wait()}); see {self._log.name}")

    def run(self, workload: Path) -> dict:
        self.process.stdin.write(json.dumps({"cmd": "run", "workload": str(workload)}) + "\n")
        self.process.stdin.flush()
        reply = self._read()
        reply["settle_s"] = self.settle()
        return reply

    def settle(self, idle_fraction: float = 0.05, interval_s: float = 0.25, limit_s: float = 10.0) -> float:
        """Wait until this engine's processes are idle (under ``idle_fraction`` of a core over ``interval_s``);
        returns the wait. vLLM's processes keep a core busy for about a second after ``generate`` returns
        (measured: ~1 CPU-second), which a run started at once on the same cores would pay for."""
        started = time.monotonic()
        before = _cpu_seconds(self.process.pid)
        while time.monotonic() - started < limit_s:
            time.sleep(interval_s)
            now = _cpu_seconds(self.process.pid)
            if now - before < idle_fraction * interval_s:
                break
            before = now
        return time.monotonic() - started

    def close(self) -> None:
        self.peak_rss_gib = _peak_rss_gib(self.process.pid)  # read before the engine exits
        try:
            self.process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.process.stdin.close()
            self.process.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        self._log.close()


def parse_configs(args) -> list[tuple[str, str, int]]:
    """(model size, dtype, threads) to run: ``--configs`` or every size x dtype x thread count."""
    if args.configs:
        out = []
        for item in args.configs.split(","):
            size, dtype, threads = item.split(":")
            out.append((size, dtype, int(threads)))
        return out
    return [(size, dtype, int(threads)) for size in args.model_size.split(",") for dtype in args.dtypes.split(",")
            for threads in args.threads.split(",")]


def size_workload(args, size: str) -> dict:
    """The offline workload's size for ``size``: the command line's, or a smaller default for the large shapes."""
    base = {"num_prompts": args.num_prompts, "min_prompt_len": args.min_prompt_len,
            "max_prompt_len": args.max_prompt_len, "output_len": args.output_len}
    return base | LARGE_WORKLOADS.get(size, {}) if not args.no_large_workloads else base


def _offline_config(args, size: str, dtype: str, threads: int, cores: list[int], venv: Path, scratch: Path,
                    bandwidth: dict) -> dict:
    import torch
    from transformers import AutoTokenizer

    is_int8 = dtype == "int8"
    checkpoint = peer_checkpoint(size, is_int8)
    engine_dtype = "bfloat16" if is_int8 else dtype  # W8A8: int8 linears, bf16 everything else
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    special = set(tokenizer.all_special_ids)
    shape = size_workload(args, size)
    workload = offline_workload(argparse.Namespace(seed=args.seed, **shape), len(tokenizer), special)
    workload_path, warmup_path = scratch / f"workload-{size}.json", scratch / f"warmup-{size}.json"
    workload_path.write_text(json.dumps(workload))
    warmup_path.write_text(json.dumps({k: v[:4] for k, v in workload.items()}))
    pythons = {"tandem": Path(sys.executable), "vllm": venv_python(venv)}
    used = cores[:threads]
    commands: dict[str, str] = {}
    versions: dict[str, dict] = {}
    started: list[OfflineRunner] = []

    def start(engine: str) -> OfflineRunner:
        runner = OfflineRunner(engine, pythons[engine], checkpoint, engine_dtype, used, warmup_path,
                               args.log_dir / f"offline-{engine}-{size}-{dtype}-{threads}t.log", args.kv_cache_gib)
        commands[engine], versions[engine] = " ".join(runner.command), runner.versions
        started.append(runner)
        return runner

    # Both engines loaded at once, their repeats alternating (A B B A ...: drift falls on both alike); with
    # --one-engine-at-a-time each is loaded, runs every repeat and is closed before the other starts (a model
    # whose two engines do not fit in memory together)
    alone = args.one_engine_at_a_time
    runners = {} if alone else {engine: start(engine) for engine in ("tandem", "vllm")}
    runs: dict[str, list[dict]] = {"tandem": [], "vllm": []}
    tokens: dict[str, list] = {}
    decode = None
    order = ([(r, e) for e in ("tandem", "vllm") for r in range(args.repeats)] if alone else
             [(r, e) for r in range(args.repeats) for e in (("tandem", "vllm") if r % 2 == 0 else ("vllm", "tandem"))])
    try:
        for repeat, engine in order:
            if engine not in runners:
                for other in [e for e in runners if e != engine]:
                    runners.pop(other).close()
                runners[engine] = start(engine)
            reply = runners[engine].run(workload_path)
            tokens[engine] = reply.pop("token_ids")
            reply["output_tokens_per_s"] = reply["output_tokens"] / reply["wall_s"]
            reply["loadavg_1min"] = os.getloadavg()[0]
            runs[engine].append(reply)
            print(f"offline {size} {dtype} {threads}t repeat {repeat}: {engine:>6} {reply['wall_s']:6.2f} s "
                  f"{reply['output_tokens_per_s']:7.1f} tok/s", flush=True)
        if dtype == "bfloat16" and size in args.decode_latency.split(",") and not alone:
            paths = peer_decode.write_workloads(scratch, len(tokenizer), special, args.decode_prompt_len,
                                                args.decode_tokens, args.seed)
            decode = peer_decode.measure(runners, paths, args.decode_tokens, args.repeats, threads)
            decode |= peer_decode.against_bound(decode, weight_bytes_per_token(checkpoint, torch.bfloat16),
                                                decode["bandwidth_during"])
    finally:
        for runner in runners.values():
            runner.close()
    medians = {e: statistics.median(r["output_tokens_per_s"] for r in runs[e]) for e in runs}
    return {
        "model_size": size, "dtype": dtype, "engine_dtype": engine_dtype, "checkpoint": str(checkpoint),
        "threads": threads, "cores": used, "runs": runs, "versions": versions,
        "workload": shape | {"total_prompt_tokens": sum(map(len, workload["prompt_token_ids"]))},
        "median_output_tokens_per_s": medians,
        "ratio_tandem_over_vllm": medians["tandem"] / medians["vllm"],
        "ratio_per_repeat": [t["output_tokens_per_s"] / v["output_tokens_per_s"]
                             for t, v in zip(runs["tandem"], runs["vllm"])],
        "requests_token_identical": sum(a == b for a, b in zip(tokens["tandem"], tokens["vllm"])),
        "num_requests": len(workload["max_tokens"]),
        "batch1_decode": decode,
        "commands": commands,
        "peak_rss_gib": {runner.engine: runner.peak_rss_gib for runner in started},
        "one_engine_at_a_time": alone,
    }


def run_offline(args, venv: Path, cores: list[int], scratch: Path) -> dict:
    configs = parse_configs(args)
    bandwidth = {threads: memory_bandwidth.measure(threads) for threads in sorted({t for _, _, t in configs})}
    for threads, report in bandwidth.items():
        print(f"memory bandwidth, {threads} thread(s): copy {report['copy']['median_gb_s']:.1f} GB/s, "
              f"read {report['read']['median_gb_s']:.1f} GB/s", flush=True)
    results = [_offline_config(args, size, dtype, threads, cores, venv, scratch, bandwidth)
               for size, dtype, threads in configs]
    return {"workload": {"seed": args.seed, "sampling": "greedy, ignore_eos, prefix caching off",
                         "per_config": "each config's 'workload'"},
            "settings": {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "max_model_len": 2048,
                         "kv_cache_gib": args.kv_cache_gib},
            "memory_bandwidth": {str(t): r for t, r in bandwidth.items()},
            "configs": results}
