"""Serving benchmark for any OpenAI-compatible endpoint (``tandem bench serve``), in the conventions
of vLLM's ``bench serve`` and SGLang's ``bench_serving``.

Open-loop arrivals precomputed from a seed (Poisson, or gamma with ``--burstiness``), optionally
capped by ``--max-concurrency``; warm-up requests excluded; a ``--request-rate`` sweep replays the
same arrival pattern with fresh prompts of the same shapes at every rate. Workloads: ``random`` (fixed input/output lengths) and ``mixed`` (a fraction
of long-prompt/short-output requests among short-prompt/long-output ones: the case disaggregation is
for), prompts built from the server's tokenizer so lengths are exact. Metrics use vLLM's key names
(``bench/serve_metrics.py``), per request group too; against a Tandem router the report adds the
server's counts, KV bytes and transfer time per request, and the leak check (``bench/tandem_scrape.py``).
Writes JSON (``--out``) and PNG plots next to it::

    tandem bench serve --base-url http://127.0.0.1:8000 --dataset mixed --num-prompts 100 \\
        --request-rate 0.5,1,2 --goodput ttft:2000 tpot:100 --out bench/results/serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import httpx

from bench import tandem_scrape
from bench.serve_cli import add_arguments, parse_rates
from bench.serve_client import ClientSettings, run_requests
from bench.serve_metrics import errors_seen, goodput_rate, parse_goodput, summarize, summarize_by_group
from bench.serve_workload import CHAT_ENDPOINT, PromptBuilder, WorkloadSpec, build_workload, scheduled

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

IDLE_GAP_S = 2.0  # between the runs of a sweep, for a server whose idleness cannot be read


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        dataset=args.dataset, num_prompts=args.num_prompts, input_len=args.random_input_len,
        output_len=args.random_output_len, long_fraction=args.mixed_long_fraction,
        long_input_len=args.mixed_long_input_len, long_output_len=args.mixed_long_output_len,
        short_input_len=args.mixed_short_input_len, short_output_len=args.mixed_short_output_len, seed=args.seed,
    )


def served_models(base_url: str, headers: dict[str, str]) -> list[dict]:
    """The server's model cards (``/v1/models``); empty when it lists none."""
    response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0)
    response.raise_for_status()
    return response.json().get("data") or []


def load_tokenizer(tokenizer: str | None, model: str, cards: list[dict]):
    """``--tokenizer``, else the model if it names a directory, else the card's ``root`` (vLLM and
    Tandem list the checkpoint directory there)."""
    from transformers import AutoTokenizer

    if tokenizer is None:
        roots = [c.get("root") for c in cards if c.get("id") == model and c.get("root")]
        candidates = [model, *roots]
        tokenizer = next((c for c in candidates if Path(c).is_dir()), None)
        if tokenizer is None:
            raise ValueError(f"cannot tell where the tokenizer of {model!r} is: pass --tokenizer DIR")
    return tokenizer, AutoTokenizer.from_pretrained(tokenizer)


def benchmark(client: ClientSettings, spec: WorkloadSpec, rates: list[float], *, tokenizer, burstiness: float = 1.0,
              slos: dict[str, float] | None = None, attainment_target: float = 0.9, num_warmups: int = 2,
              progress: bool = True, label: str | None = None) -> dict:
    """Run the workload once per rate against one server; the report (no file written)."""
    slos = slos or {}
    headers = {"Authorization": f"Bearer {client.api_key}"} if client.api_key else {}
    count_tokens = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    prompts = PromptBuilder(tokenizer, is_chat=client.endpoint == CHAT_ENDPOINT)
    if num_warmups:
        warmups = build_workload(replace(spec, num_prompts=num_warmups), prompts, salt=-1)
        asyncio.run(run_requests(replace(client, max_concurrency=1), warmups, count_tokens))
    runs = []
    before = tandem_scrape.wait_until_idle(client.base_url, headers)  # each run's "after" is the next one's "before"
    for index, rate in enumerate(rates):
        # fresh prompts for every run (no prefix-cache hits on an earlier run's), the same for every system
        requests = build_workload(spec, prompts, salt=index)
        if before is None:
            time.sleep(IDLE_GAP_S)
        timed = scheduled(requests, rate, burstiness, spec.seed)
        bar = _progress_bar(len(timed), f"{label or 'server'} @ {rate:g} req/s", progress)
        outcomes, duration = asyncio.run(run_requests(client, timed, count_tokens, on_done=lambda _: bar.update()))
        bar.close()
        run = {"request_rate": rate, "burstiness": burstiness, "max_concurrency": client.max_concurrency,
               **summarize(outcomes, duration, slos)}
        groups = summarize_by_group(outcomes, duration, slos)
        if groups:
            run["groups"] = groups
        run["errors"] = errors_seen(outcomes)
        if before is not None:
            after = tandem_scrape.wait_until_idle(client.base_url, headers)
            run["tandem"] = tandem_scrape.run_report(before, after, run["completed"])
            before = after
        runs.append(run)
    report = {
        "benchmark": "serve", "label": label, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "base_url": client.base_url, "endpoint": client.endpoint, "model": client.model,
        "workload": asdict(spec), "num_warmups": num_warmups, "goodput_slos": slos,
        "attainment_target": attainment_target, "runs": runs,
    }
    if slos:
        report["goodput_rate"] = goodput_rate(runs, attainment_target)
    return report


def _progress_bar(total: int, description: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=description, unit="req", disable=not enabled, leave=False)


def print_summary(report: dict) -> None:
    keys = ["completed", "failed", "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p99_tpot_ms", "p99_itl_ms"]
    if report["goodput_slos"]:
        keys += ["request_goodput", "slo_attainment"]
    print(f"== {report.get('label') or report['base_url']} ({report['workload']['dataset']}, "
          f"{report['workload']['num_prompts']} requests) ==")
    print("rate      " + "".join(f"{k:>20}" for k in keys))
    for run in report["runs"]:
        cells = "".join(f"{run[k]:>20.4g}" if isinstance(run[k], float) else f"{run[k]:>20}" for k in keys)
        print(f"{run['request_rate']:<10g}{cells}")
        if run.get("tandem"):
            t = run["tandem"]
            print(f"          server: {t['requests_by_outcome']}, KV {t['kv_bytes_received_per_request'] / 1e6:.2f} MB "
                  f"and {t['kv_transfer_ms_per_request']:.1f} ms per request, leak check {t['leak_check']}")
        for error in run["errors"]:
            print(f"          error: {error}")
    if report.get("goodput_slos"):
        print(f"goodput rate (SLO attainment >= {report['attainment_target']:.0%}): {report.get('goodput_rate')}")


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    if parser is None:
        parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        add_arguments(parser)
    args = parser.parse_args(argv)
    return run_from_args(args)


def run_sessions_from_args(args: argparse.Namespace, base_url: str, model: str, tokenizer) -> dict:
    """``--dataset multi-turn``: the conversations of ``bench/serve_sessions.py``, with the server's side."""
    from bench.serve_sessions import SessionSpec, build_sessions, run_sessions, summarize_turns

    spec = SessionSpec(num_sessions=args.multi_turn_sessions, num_turns=args.multi_turn_turns,
                       system_len=args.multi_turn_system_len, user_len=args.multi_turn_user_len,
                       output_len=args.multi_turn_output_len, session_rate=args.multi_turn_session_rate,
                       think_time_s=args.multi_turn_think_time,
                       think_time_distribution=args.multi_turn_think_time_distribution, seed=args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    before = tandem_scrape.wait_until_idle(base_url, headers)
    sessions = build_sessions(spec, len(tokenizer), set(tokenizer.all_special_ids))
    outcomes, duration = asyncio.run(run_sessions(base_url, model, spec, sessions, args.api_key))
    report = {"benchmark": "serve_multi_turn", "label": args.label, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "base_url": base_url, "model": model, "workload": asdict(spec), **summarize_turns(outcomes, duration)}
    after = tandem_scrape.wait_until_idle(base_url, headers)
    if before is not None and after is not None:
        report["tandem"] = tandem_scrape.run_report(before, after, len(outcomes))
    for turn, stats in report["per_turn"].items():
        print(f"turn {turn}: {stats['count']} done, median TTFT {stats['median_ttft_ms']:.1f} ms, "
              f"{stats['cached_fraction']:.0%} of the prompt already held")
    server = report.get("tandem")
    if server:
        computed = ", ".join(f"{role} {n:.0f}" for role, n in server["prompt_tokens_computed_per_request"].items())
        hits = ", ".join(f"{side} {server[f'prefix_hit_rate_{side}']:.0%}" for side in ("decode", "prefill")
                         if f"prefix_hit_rate_{side}" in server)
        warmed = ", ".join(f"{role} {n:.0f}" for role, n in server["warmup_tokens_computed_per_request"].items())
        print(f"per turn: prompt tokens computed {computed or 0} (warm-ups in idle steps: {warmed or 0}); "
              f"KV bytes sent {server['kv_bytes_sent_per_request']:.0f}; prefix hit rate at routing {hits or 'n/a'}")
    return report


def run_from_args(args: argparse.Namespace) -> int:
    rates = parse_rates(args.request_rate)
    slos = parse_goodput(args.goodput)
    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    cards = served_models(base_url, headers) if args.model is None or args.tokenizer is None else []
    if args.model is None and not cards:
        raise ValueError(f"{base_url}/v1/models lists no model: pass --model")
    model = args.model or cards[0]["id"]
    tokenizer_path, tokenizer = load_tokenizer(args.tokenizer, model, cards)
    if args.dataset == "multi-turn":
        report = run_sessions_from_args(args, base_url, model, tokenizer)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2))
            print(f"wrote {args.out}")
        return 0
    client = ClientSettings(base_url=base_url, endpoint=args.endpoint, model=model, api_key=args.api_key,
                            ignore_eos=args.ignore_eos, max_concurrency=args.max_concurrency)
    report = benchmark(client, workload_spec(args), rates, tokenizer=tokenizer, burstiness=args.burstiness,
                       slos=slos, attainment_target=args.attainment_target, num_warmups=args.num_warmups,
                       progress=not args.no_progress, label=args.label)
    report["tokenizer"] = tokenizer_path
    print_summary(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
        if not args.no_plot:
            from bench.serve_plot import render_serve

            for path in render_serve(report, args.out):
                print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, httpx.HTTPError) as exc:
        print(f"bench.serve: error: {exc}", file=sys.stderr)
        sys.exit(2)
