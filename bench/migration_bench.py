"""How long a stream pauses when its worker dies or drains, against its context length (``make bench-migration``)::

    python -m bench.migration_bench --mode crash --out bench/results/migration.json
    python -m bench.migration_bench --mode drain --out bench/results/migration_drain.json

``--mode crash``: a cluster of two colocated workers (the medium random model, each worker on its own
core, restarts on) serves one greedy stream at a time. Once the stream has its first ``--tokens-before``
tokens, the worker serving it is SIGKILLed. ``--mode drain``: 1 prefill + 2 decode workers; the decode
worker serving the stream gets SIGTERM and hands the stream off with its KV (live migration).
``--mode drain-replay``: the same drain with ``transfer.kv_migration_on_drain`` off and no drain grace,
so the stream migrates by replay (the comparison). The stream's pause is the gap between its last chunk
before the signal and its first chunk after, split in two:

* **detection**: signal to the router's migration (``tandem_migrations_total``, polled every 10 ms).
  A crash is bounded by ``router.dead_after_s`` (a killed worker goes silent); a drain is the worker
  pausing the stream and offering it;
* **move**: migration to the next chunk. Replay: the other worker computes the prompt and the tokens
  already sent, then samples the next one. Drain: it receives their KV instead, then decodes.

Every stream's full text is checked against the same request run without a kill (afterwards, so the
replay finds nothing of the prompt in the other worker's prefix cache). The report holds
every trial; a plot of the pause per context length is written beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import threading
import time
from pathlib import Path

import httpx


def migrations(url: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
               if line.startswith("tandem_migrations_total{"))


def running_on(url: str) -> dict[str, float]:
    """{worker: running requests} from the router's /metrics (each worker's last heartbeat)."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("tandem_worker_running_requests{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
            out[labels["worker"].strip('"')] = float(line.rsplit(" ", 1)[1])
    return out


def one_trial(cluster, model: str, prompt: list[int], max_tokens: int, tokens_before: int, sig: int) -> dict:
    url = cluster.url
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    chunks: list[tuple[float, str]] = []
    reached = threading.Event()

    def consume():
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    chunk = json.loads(line[5:])
                    if chunk.get("choices"):
                        chunks.append((time.monotonic(), chunk["choices"][0]["text"]))
                        if len(chunks) >= tokens_before:
                            reached.set()

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    assert reached.wait(120), "the stream did not start"
    running = {}
    deadline = time.monotonic() + 5
    while not any(running.values()):
        running = running_on(url)
        assert time.monotonic() < deadline, "no worker reports the stream"
        time.sleep(0.02)
    victim = max(running, key=running.get)
    before = migrations(url)
    old_pid = cluster.pids[victim]
    killed_at = time.monotonic()
    if sig == signal.SIGTERM:  # a planned replacement (the worker drains): no restart backoff for the next trial
        threading.Thread(target=cluster.rolling_restart, args=([victim],), daemon=True).start()
    else:
        cluster.kill(victim, sig)
    while migrations(url) == before:
        time.sleep(0.01)
    migrated_at = time.monotonic()
    thread.join(300)
    # chunks the dead worker sent before the kill may be read after it: the pause is the gap around the
    # migration (the first chunk after it came from the new worker)
    after = [t for t, _ in chunks if t > migrated_at]
    last_before = max(t for t, _ in chunks if t <= migrated_at)
    text = "".join(piece for _, piece in chunks)
    deadline = time.monotonic() + 60
    while cluster.pids.get(victim) in (None, old_pid) or victim not in {
            w["worker_id"] for w in httpx.get(f"{url}/ready", timeout=5).json()["workers"] if w["alive"]}:
        assert time.monotonic() < deadline, f"{victim} did not come back"
        time.sleep(0.2)
    num_before = sum(1 for t, _ in chunks if t <= migrated_at)
    # the uninterrupted answer, asked for afterwards so that no worker held this prompt during the trial
    reference = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    if reference.status_code != 200:
        raise RuntimeError(f"the reference request failed: {reference.status_code} {reference.text[:300]}")
    want = reference.json()["choices"][0]["text"]
    return {"prompt_tokens": len(prompt), "chunks_before_migration": num_before,
            "context_tokens": len(prompt) + num_before,
            "pause_ms": (after[0] - last_before) * 1000, "detection_ms": (migrated_at - killed_at) * 1000,
            "move_ms": (after[0] - migrated_at) * 1000, "text_identical": text == want}


MODES = {  # (prefill, decode, colocated workers), signal, config
    "crash": ((0, 0, 2), signal.SIGKILL, {}),
    "drain": ((1, 2, 0), signal.SIGTERM, {"router": {"max_local_prefill_length": 0}}),
    "drain-replay": ((1, 2, 0), signal.SIGTERM, {"router": {"max_local_prefill_length": 0}, "drain_timeout_s": 0.0,
                                                 "transfer": {"kv_migration_on_drain": False}}),
}


def recomputed_tokens_and_kv_bytes(url: str) -> tuple[float, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        for name in ("tandem_migration_recomputed_tokens_total", "tandem_migration_kv_bytes_total"):
            if line.startswith(name + " "):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values.get("tandem_migration_recomputed_tokens_total", 0.0), values.get("tandem_migration_kv_bytes_total", 0.0)


def main(argv: list[str] | None = None) -> int:
    from bench.peer_transformers import free_port
    from bench.serve_compare import benchmark_checkpoint, cpu_model
    from deploy.cpu_plan import plan_cores, router_cores
    from deploy.local_launcher import LocalCluster

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=list(MODES), default="crash")
    parser.add_argument("--out", type=Path, default=Path("bench/results/migration.json"))
    parser.add_argument("--model-size", default="medium")
    parser.add_argument("--prompt-lens", default="64,512,1024,1536")
    parser.add_argument("--tokens-before", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dead-after", type=float, default=1.0, help="router.dead_after_s (detection bound)")
    args = parser.parse_args(argv)
    checkpoint = benchmark_checkpoint(args.model_size)
    cores = sorted(os.sched_getaffinity(0))
    (num_prefill, num_decode, num_colocated), sig, mode_config = MODES[args.mode]
    plan = plan_cores(cores, num_prefill, num_decode, num_colocated)
    config = {"router": {"dead_after_s": args.dead_after}, "transfer": {"heartbeat_interval_s": 0.2}}
    for section, values in mode_config.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    cluster = LocalCluster(num_prefill=num_prefill, num_decode=num_decode, num_colocated=num_colocated,
                           model_path=str(checkpoint),
                           port=free_port(), cpu_plan=plan, router_cores=router_cores(plan), config=config,
                           max_restarts=100)
    trials = []
    with cluster:
        model = httpx.get(f"{cluster.url}/v1/models", timeout=10).json()["data"][0]["id"]
        vocab = httpx.get(f"{cluster.url}/tokenizer_info", timeout=10).json()["vocab_size"]
        for length in (int(n) for n in args.prompt_lens.split(",")):
            for repeat in range(args.repeats):
                prompt = [(7 * i + 13 * repeat + length) % (vocab - 10) + 5 for i in range(length)]
                recomputed, kv_bytes = recomputed_tokens_and_kv_bytes(cluster.url)
                trial = one_trial(cluster, model, prompt, args.max_tokens, args.tokens_before, sig)
                after_recomputed, after_kv_bytes = recomputed_tokens_and_kv_bytes(cluster.url)
                trial.update(recomputed_tokens=after_recomputed - recomputed, kv_bytes_moved=after_kv_bytes - kv_bytes)
                trials.append(trial)
                print(json.dumps(trial), flush=True)
    summary = {}
    for length in sorted({t["prompt_tokens"] for t in trials}):
        rows = [t for t in trials if t["prompt_tokens"] == length]
        summary[str(length)] = {key: statistics.median(t[key] for t in rows)
                                for key in ("context_tokens", "pause_ms", "detection_ms", "move_ms",
                                            "recomputed_tokens", "kv_bytes_moved")}
    report = {"benchmark": "migration", "mode": args.mode, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu_model(),
              "cores": cores, "checkpoint": str(checkpoint), "dead_after_s": args.dead_after,
              "trials": trials, "median_by_prompt_tokens": summary,
              "all_text_identical": all(t["text_identical"] for t in trials)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")
    print(f"wrote {plot(report, args.out.with_suffix('.png'))}")
    return 0


def plot(report: dict, out: Path) -> Path:
    """Median pause per context length, split into detection and replay."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["median_by_prompt_tokens"]
    labels = [f"{int(r['context_tokens'])}" for r in rows.values()]
    detection = [r["detection_ms"] for r in rows.values()]
    move = [r["move_ms"] for r in rows.values()]
    mode = report.get("mode", "crash")
    fig, axis = plt.subplots(figsize=(8, 4.5))
    axis.bar(labels, detection, label=f"detection (dead_after_s {report['dead_after_s']:g})" if mode == "crash"
             else "detection (SIGTERM to the router's handoff)")
    axis.bar(labels, move, bottom=detection, label="receive the KV, decode" if mode == "drain"
             else "replay (recompute prompt + tokens so far)")
    what = {"crash": "is SIGKILLed", "drain": "drains (KV moved)", "drain-replay": "drains (replayed)"}[mode]
    axis.set(xlabel="context at the signal (tokens)", ylabel="pause of the stream (ms, median)",
             title=f"A stream whose worker {what}: pause until its next token ({report['cpu']})")
    axis.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
