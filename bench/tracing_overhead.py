"""What OpenTelemetry tracing costs (``--otlp-traces-endpoint``; docs/observability.md, "Traces")::

    python -m bench.tracing_overhead --out bench/results/tracing_overhead.json

Two measurements:

* **cluster**: a 1P1D ``LocalCluster`` (built-in model, every prompt prefilled remotely and its KV
  transferred) serves ``--concurrency`` closed-loop clients, ``--requests`` greedy completions of
  ``--max-tokens`` tokens in all per round; output tokens per second, tracing off and on, rounds
  alternating between the two clusters (both up at once) so that other load on the machine falls on
  both alike. Tracing on exports to an OTLP/HTTP receiver in this process (``bench/otlp_receiver.py``);
  the off cluster's processes get ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` pointing at a second receiver,
  which the SDK would use if any exporter were created there: it must receive nothing.
* **no-op path**: the tracing calls one request makes at the router and on its two workers (a request
  trace, worker spans started, switched, counted per token and ended), timed in this process with
  tracing off and on (spans batched to an exporter that drops them), in microseconds per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from bench.otlp_receiver import OtlpReceiver
from bench.startup_bench import cpu_description

PROMPT_TOKENS = 48


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_cluster(log_dir: Path, config: dict, env: dict):
    from deploy.local_launcher import LocalCluster

    base = {"kv_cache": {"page_size": 16, "num_blocks": 1024}, "router": {"max_local_prefill_length": 0}}
    cluster = LocalCluster(num_prefill=1, num_decode=1, port=_free_port(), config={**base, **config},
                           log_dir=log_dir, env=env)
    return cluster.start(timeout_s=300)


async def _round(url: str, num_requests: int, concurrency: int, max_tokens: int, seed: int) -> dict:
    """``num_requests`` completions by ``concurrency`` clients; distinct prompts (no prefix-cache hits)."""
    queue = list(range(num_requests))
    num_tokens = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal num_tokens
        while queue:
            i = queue.pop()
            prompt = [(seed * 7919 + i * 131 + j * 17) % 500 + 10 for j in range(PROMPT_TOKENS)]
            response = await http.post(f"{url}/v1/completions", json={
                "model": "tandem-builtin", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True})
            response.raise_for_status()
            num_tokens += response.json()["usage"]["completion_tokens"]

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "output_tokens": num_tokens, "tok_per_s": num_tokens / seconds}


def cluster_runs(args, log_root: Path) -> dict:
    with OtlpReceiver() as collector, OtlpReceiver() as stray:
        # the off cluster: no endpoint configured, but the SDK's own variable points at ``stray``
        off = start_cluster(log_root / "off", {}, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{stray.endpoint}/v1/traces"})
        try:
            on = start_cluster(log_root / "on", {"otlp_traces_endpoint": collector.endpoint}, {})
            try:
                clusters = {"off": off, "on": on}
                for name, cluster in clusters.items():  # warm-up: first requests compile and fault pages in
                    asyncio.run(_round(cluster.url, args.concurrency, args.concurrency, args.max_tokens, seed=999))
                rounds: dict[str, list[dict]] = {"off": [], "on": []}
                for r in range(args.rounds):
                    order = ("off", "on") if r % 2 == 0 else ("on", "off")
                    for name in order:
                        result = asyncio.run(_round(clusters[name].url, args.requests, args.concurrency,
                                                    args.max_tokens, seed=r))
                        rounds[name].append(result)
                        print(f"round {r} tracing {name}: {result['tok_per_s']:.1f} tok/s", flush=True)
            finally:
                on.stop()
        finally:
            off.stop()
        time.sleep(0.5)  # the last batches (flushed at shutdown) arrive
        spans = collector.spans  # warm-up and rounds: every request's spans, flushed as the processes stopped
        num_traced = sum(s.name == "tandem.request" for s in spans)
        num_requests = (args.rounds * args.requests + args.concurrency)
    report = {name: {"rounds": results, "median_tok_per_s": statistics.median(r["tok_per_s"] for r in results)}
              for name, results in rounds.items()}
    report["on"]["requests_traced"] = f"{num_traced} of {num_requests}"
    report["on"]["spans_per_request"] = len(spans) / max(num_traced, 1)
    report["on"]["span_names"] = sorted({s.name for s in spans})
    report["off"]["spans_exported"] = len(stray.spans)
    report["off"]["export_posts"] = stray.num_posts
    report["slowdown_pct"] = 100 * (1 - report["on"]["median_tok_per_s"] / report["off"]["median_tok_per_s"])
    return report


def _one_request(tokens: int) -> None:
    """The tracing calls of one P/D request: router, prefill worker, decode worker (one call set per token)."""
    from pipeline import tracing
    from router.request_trace import request_trace

    trace = request_trace("r", PROMPT_TOKENS, tokens, 0, {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
    trace.admitted()
    trace.routed(_ROUTE, "r", 1, PROMPT_TOKENS, None)
    prefill, decode = tracing.request_spans(), tracing.request_spans()
    prefill.start("r", "prefill", parent=trace.context, attributes={"tandem.request_id": "r"})
    prefill.start("r", "prefill.queue", parent="prefill")
    prefill.switch("r", ("prefill.queue",), "prefill.compute", parent="prefill")
    prefill.end("r", "prefill.compute", {"tandem.num_cached_tokens": 0})
    prefill.transfer("r", "kv_transfer.send", "prefill", _TRANSFER, num_blocks=3)
    prefill.end_all("r")
    decode.start("r", "decode", parent=trace.context, attributes={"tandem.request_id": "r"})
    decode.start("r", "decode.queue", parent="decode")
    decode.transfer("r", "kv_transfer.receive", "decode", _TRANSFER, ends="decode.queue")
    for _ in range(tokens):
        decode.switch("r", ("decode.queue", "decode.local_prefill"), "decode.decoding", parent="decode")
        decode.count("r", "decode.decoding", "tandem.num_output_tokens", 1)
    decode.end_all("r")
    trace.finished("finished", tokens)


def noop_path(tokens: int, num_requests: int) -> dict:
    from opentelemetry.sdk.trace.export import SpanExportResult

    from pipeline import tracing
    from pipeline.tracing.otlp import OtlpTracing

    class Dropping:
        def export(self, spans):
            return SpanExportResult.SUCCESS

        def shutdown(self):
            pass

        def force_flush(self, timeout_millis=30000):
            return True

    def per_request_us() -> float:
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(num_requests):
                _one_request(tokens)
            best = min(best, (time.perf_counter() - started) / num_requests * 1e6)
        return best

    result = {"tokens_per_request": tokens, "off_us_per_request": per_request_us()}
    tracing._backend = OtlpTracing("http://127.0.0.1:9", "bench", "w0", exporter=Dropping())
    try:
        result["on_us_per_request"] = per_request_us()
    finally:
        tracing.shutdown()
    return result


_TRANSFER = SimpleNamespace(ok=True, error=None, num_bytes=1 << 20, transport="shm", seconds=0.004)


def _route():
    from pipeline.config import PipelineRole
    from router.policy import Route, WorkerView

    return Route(decode=WorkerView("d0", PipelineRole.DecodeOnly, 4096),
                 prefill=WorkerView("p0", PipelineRole.PrefillOnly, 4096, prefill_endpoint="ipc:///p"))


_ROUTE = _route()


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    cluster = report["cluster"]
    for x, name in enumerate(("off", "on")):
        values = [r["tok_per_s"] for r in cluster[name]["rounds"]]
        left.bar(x, cluster[name]["median_tok_per_s"], color="tab:blue" if name == "off" else "tab:orange", alpha=0.7)
        left.scatter([x] * len(values), values, color="black", s=12, zorder=3)
    left.set_xticks([0, 1], ["tracing off", "tracing on"])
    left.set_ylabel("output tokens / s (median; dots: rounds)")
    left.set_title(f"1P1D cluster, {report['settings']['concurrency']} clients: "
                   f"{cluster['slowdown_pct']:+.1f}% slower on", fontsize="medium")
    noop = report["noop_path"]
    right.barh([0, 1], [noop["off_us_per_request"], noop["on_us_per_request"]], color=["tab:blue", "tab:orange"])
    right.set_yticks([0, 1], ["off (no-op)", "on (spans made)"])
    right.set_xlabel(f"µs per request of tracing calls ({noop['tokens_per_request']} tokens)")
    right.set_xscale("log")
    fig.suptitle(report["cpu"].get("model", ""), fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32, help="requests per round")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default="bench/results/tracing_overhead.json")
    parser.add_argument("--log-dir", default=None, help="the clusters' logs (default: a temporary directory)")
    args = parser.parse_args()
    import tempfile

    log_root = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-tracing-bench-"))
    report = {"benchmark": "tracing_overhead", "cpu": cpu_description(), "load_avg_before": os.getloadavg(),
              "settings": vars(args) | {"prompt_tokens": PROMPT_TOKENS}}
    report["noop_path"] = noop_path(args.max_tokens, 2000)
    print(f"no-op path: {report['noop_path']['off_us_per_request']:.2f} µs/request off, "
          f"{report['noop_path']['on_us_per_request']:.1f} µs/request on", flush=True)
    report["cluster"] = cluster_runs(args, log_root)
    report["load_avg_after"] = os.getloadavg()
    cluster = report["cluster"]
    print(f"cluster: {cluster['off']['median_tok_per_s']:.1f} tok/s off, {cluster['on']['median_tok_per_s']:.1f} "
          f"on ({cluster['slowdown_pct']:+.1f}%); {cluster['on']['spans_per_request']:.1f} spans per request; "
          f"off exported {cluster['off']['spans_exported']} spans", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    try:
        plot(report, out.with_suffix(".png"))
    except ImportError:
        print("no plot: matplotlib is not installed (pip install -e '.[bench]')", flush=True)


if __name__ == "__main__":
    main()
