"""Speculative decoding: decode throughput with a draft model off and on, acceptance, and what a verify costs.

The target is a random-weight llama (default hidden 1024, SwiGLU 2816, 8 layers, 16 query / 4 KV heads,
vocabulary 2048, fp32, CPU: ~93M parameters, a decode step of tens of ms at batch 1, so the model and not
the engine's host code is most of a step, as on a real deployment). The draft is its first
``--draft-layers`` layers (``bench/draft_checkpoint.py`` ``truncated_copy``: same embeddings, final norm
and head). A plain random llama makes a useless pair: its layers are random maps of similar size, so the
first layer alone predicts the target's greedy token ~0% of the time (measured: 2 of 2210 drafts). Real
models refine, most of what the last layers add is small; the target is built so: the residual
outputs (``o_proj``, ``down_proj``) of every layer after the first are scaled by ``--late-layer-scale``
(default 0.05; the shapes, so the costs, are unchanged). That scale sets the acceptance; at 0.05 a
1-layer draft is accepted about half the time at K = 4 (0.03: 0.54, 0.1: 0.30): a useful draft, not a
perfect one; and greedy outputs stay varied (``distinct_token_share``: a looping output
would be accepted trivially). The draft is 1 layer (``--draft-layers``), picked by measuring 1 and 2 on
this target (1 thread): the second layer is one of the scaled ones, so it barely moves the acceptance
(batch 1, K = 2: 0.65 -> 0.69, K = 4: 0.54 -> 0.54) while a draft step goes from 0.15 to 0.29 of a target
step; the 2-layer draft measured slower in all four cases (on / off, 3 repeats, batch 1 / 8 and K = 2 / 4:
0.76, 0.93, 0.94, 0.88 against 0.78, 1.05, 1.01, 0.93).

For each batch size (``--batch-sizes``) the same seeded random prompts (token ids) run greedy with EOS
ignored, each producing exactly ``--max-tokens``, with speculation off and with K draft tokens for each
K of ``--num-speculative-tokens`` (one engine per mode, built once, reused across batch sizes):

- one warm-up ``generate`` per mode, then ``--repeats`` timed ones, modes alternating within each repeat
  (off, k2, k4, then k4, k2, off, ...) so a noisy neighbour hits all alike. Throughput is output tokens
  over the ``generate`` wall time (prefill included, the same in every mode); the report gives medians,
  each K's ratio on / off, and the ratio within each repeat.
- every run's token ids (warm-ups included) are compared with the warm-up of speculation off:
  ``outputs_identical``. Greedy speculative decoding is exact, so this is a check, not a statistic:
  anything but true is a bug, and the summary line says so.
- each timed run counts engine steps and times, inside them, the draft's proposal and the target's
  verify forward (method wrappers on the instances, ~1 µs per call against steps of tens of ms).
- acceptance of each K: the speculator's counters over the timed runs (differences: they count since the
  engine was built): acceptance rate, mean acceptance length (tokens emitted per verify of one request,
  1..K + 1) and, per draft position, the share of verifies that accepted it.

Then the cost model, with the model forwards timed directly (``runner.model`` and ``compute_logits`` on a
``ForwardBatch`` from ``pipeline.speculative.flat_batch``, as the speculator calls them, no sampling or
host code): ``batch_size`` sequences after a ``--cost-context-len``-token context (prefilled into both
models' KV), each with 1 token (a decode step) or K + 1 tokens (a verify, K + 1 rows of logits), and one
1-token draft forward. ``--cost-reps`` rounds, the forwards alternating within each; medians.
``verify_cost_ratio`` = t(K + 1 tokens) / t(1 token), ``draft_step_ratio`` = t(draft step) / t(target step),
and the simple model's speedup = mean acceptance length / (K x draft_step_ratio + verify_cost_ratio),
next to the measured on / off ratio (the model leaves out the host's extra work per step: drafting
loops, verification, several tokens appended; the first draft pass also runs 2 tokens when every draft
of the last step was accepted).

Torch runs ``--threads`` threads (default: every core, ``os.cpu_count()``) for all of it; the 1-minute
load average at the start and end is in ``settings`` (and per run), since a neighbour shows up there.
The committed report ran 1 thread: on this 2-core machine a neighbour busy on one core makes every
parallel op of a 2-thread run wait for a time slice (an attention call went from 0.05 ms to ~6 ms, whole
steps 10-30x slower), which measures the neighbour; 1 thread keeps a core to itself. Quiet, 2 threads
measured about the same (batch 1 decode step 21 ms either way: the step is bound by reading the weights).

On this CPU (AMD EPYC, torch's MKL) a matmul of 2-5 rows costs several times one of 1 row (1 row takes a
matrix-vector path), so a verify is not nearly free here as on a GPU: at batch 1 the 3-token verify
(K = 2) measured ~2.4 decode steps, more than the 5-token one (K = 4, ~2.0).

Usage::

    python -m bench.speculative_bench --threads 1 --repeats 5 --out bench/results/speculative_bench.json
    python -m bench.plot bench/results/speculative_bench.json
    python -m bench.speculative_bench --quick --out /tmp/spec.json                 # seconds: the test's settings
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.offline_throughput import _loadavg, machine_info, write_report
from bench.overlap_bench import timed_methods
from bench.speculative_costs import add_predictions, measure_costs, ordinary_tokens

PAGE_SIZE = 16
DRAFT_LAYERS = 1  # measured against 2 on the default target: see the docstring
QUICK = dict(batch_sizes="1,2", num_speculative_tokens="2", max_tokens=8, prompt_len=8, repeats=1,
             hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512,
             cost_context_len=16, cost_reps=3)
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads")
# Timed inside each run: the whole step, and in a speculative step the draft's proposal and the target's verify.
STEP_PATHS = {"step": "engine.step"}
SPEC_PATHS = {"propose": "engine.speculator.proposer.propose", "verify_forward": "engine.speculator._verify_forward"}


def mode_name(k: int) -> str:
    return "off" if k == 0 else f"k{k}"


# ------------------------------------------------------------------------------------------ models
def model_config(args) -> dict:
    if args.hidden_size % args.num_heads or args.num_heads % args.num_kv_heads:
        raise SystemExit("--hidden-size must be a multiple of --num-heads, and --num-heads of --num-kv-heads")
    return dict(
        tokenizer_vocab_size=args.vocab_size, vocab_size=args.vocab_size, hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=max(2048, args.prompt_len + args.max_tokens + 64), initializer_range=0.05,
    )


def build_models(args, tmp: Path) -> tuple[str, str, dict]:
    """(target path, draft path, how they were made)."""
    from bench.draft_checkpoint import scale_late_layers, truncated_copy

    info = dict(late_layer_scale=None, scaled_tensors=0)
    target = args.model
    if target is None:
        from pipeline.builtin_model import build_checkpoint

        target = build_checkpoint(tmp / "target", "llama", seed=args.seed, **model_config(args))
        if args.late_layer_scale != 1.0:
            info.update(late_layer_scale=args.late_layer_scale,
                        scaled_tensors=scale_late_layers(target, args.late_layer_scale))
    draft = truncated_copy(target, tmp / "draft", args.draft_layers)
    return str(target), str(draft), info


def make_llm(target: str, draft: str, k: int, args):
    """One engine: speculation off (k = 0) or K = k; its KV pool holds the largest batch at full length
    (nothing is preempted) and, later, the cost measurement's sequences."""
    from pipeline import LLM

    batch = max(args.batch_sizes)
    tokens = max(args.prompt_len + args.max_tokens, args.cost_context_len) + max(args.ks) + 1
    speculative = dict(draft_model={"model_path": draft}, speculative={"num_speculative_tokens": k}) if k else {}
    return LLM(model=target, model_config={"dtype": "float32", "device": "cpu"}, kernel_backend="torch",
               max_batch_size=batch, max_batch_input_tokens=args.max_batch_input_tokens,
               kv_cache={"page_size": PAGE_SIZE, "num_blocks": batch * -(-tokens // PAGE_SIZE) + 2}, **speculative)


def make_prompts(llm, batch_size: int, args) -> list[list[int]]:
    """Seeded prompts of ordinary (non-special) token ids, no shared prefixes."""
    rng = random.Random(args.seed + batch_size)
    ordinary = ordinary_tokens(llm)
    return [[rng.choice(ordinary) for _ in range(args.prompt_len)] for _ in range(batch_size)]


# -------------------------------------------------------------------------------------- throughput
def _counters(llm) -> dict | None:
    if llm.engine.speculator is None:
        return None
    stats = llm.engine.speculator.stats
    return dict(num_drafts=stats.num_drafts, num_draft_tokens=stats.num_draft_tokens,
                num_accepted_tokens=stats.num_accepted_tokens, accepted_per_position=list(stats.accepted_per_position))


def _difference(after: dict | None, before: dict | None) -> dict | None:
    if after is None:
        return None
    return {key: ([a - b for a, b in zip(value, before[key])] if isinstance(value, list) else value - before[key])
            for key, value in after.items()}


def run_once(llm, prompts: list[list[int]], max_tokens: int) -> tuple[dict, list[list[int]], dict | None]:
    """One timed ``generate``: (its numbers, its token ids, the speculator's counters over it or None)."""
    from pipeline import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.engine.kv_manager.reset_prefix_cache()  # each run prefills its prompts again, in every mode
    paths = {**STEP_PATHS, **(SPEC_PATHS if llm.engine.speculator is not None else {})}
    before = _counters(llm)
    with timed_methods(llm.engine, paths) as (seconds, calls, missing):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
    counts = _difference(_counters(llm), before)
    num_tokens = sum(len(o.token_ids) for o in outputs)
    if num_tokens != len(prompts) * max_tokens:
        raise RuntimeError(f"got {num_tokens} output tokens, asked for {len(prompts) * max_tokens}")
    steps = max(calls["step"], 1)
    run = dict(wall_s=wall, output_tokens=num_tokens, output_tokens_per_s=num_tokens / wall, num_steps=calls["step"],
               step_ms=1e3 * seconds["step"] / steps, loadavg_1min=_loadavg())
    for key in SPEC_PATHS:
        if key in seconds and paths[key] not in missing:
            run[f"{key}_ms_per_step"] = 1e3 * seconds[key] / steps
    if missing:
        run["missing_timers"] = missing
    return run, [list(o.token_ids) for o in outputs], counts


def summarize(runs: list[dict]) -> dict:
    summary = dict(median_output_tokens_per_s=statistics.median(r["output_tokens_per_s"] for r in runs),
                   median_wall_s=statistics.median(r["wall_s"] for r in runs),
                   median_num_steps=statistics.median(r["num_steps"] for r in runs),
                   median_step_ms=statistics.median(r["step_ms"] for r in runs))
    for key in SPEC_PATHS:
        if all(f"{key}_ms_per_step" in r for r in runs):
            summary[f"median_{key}_ms_per_step"] = statistics.median(r[f"{key}_ms_per_step"] for r in runs)
    summary["runs"] = runs
    return summary


def acceptance(counts: dict) -> dict:
    """Rates from summed counters: per draft position, the share of verifies that accepted it."""
    drafts, drafted = counts["num_drafts"], counts["num_draft_tokens"]
    emitted = counts["num_accepted_tokens"] + drafts  # each verify: its accepted drafts and one target token
    return dict(
        **counts,
        acceptance_rate=counts["num_accepted_tokens"] / drafted if drafted else 0.0,
        mean_acceptance_length=emitted / drafts if drafts else 0.0,
        acceptance_per_position=[n / drafts if drafts else 0.0 for n in counts["accepted_per_position"]],
    )


def _sum_counts(counts: list[dict]) -> dict:
    total = {key: ([0] * len(value) if isinstance(value, list) else 0) for key, value in counts[0].items()}
    for c in counts:
        for key, value in c.items():
            total[key] = [a + b for a, b in zip(total[key], value)] if isinstance(value, list) else total[key] + value
    return total


def distinct_token_share(token_ids: list[list[int]]) -> float:
    """Distinct tokens over tokens, per output, averaged: near 1 for varied text, low for a loop."""
    return statistics.mean(len(set(t)) / len(t) for t in token_ids if t)


def measure_throughput(llms: dict[int, object], batch_size: int, args) -> dict:
    """Every mode on ``batch_size`` prompts: warm-ups, timed repeats (alternating), token check, acceptance."""
    prompts = make_prompts(llms[0], batch_size, args)
    modes = list(llms)  # 0 (off) first, then each K
    warmup = {k: run_once(llms[k], prompts, args.max_tokens)[1] for k in modes}
    reference = warmup[0]
    num_identical, num_runs = sum(t == reference for t in warmup.values()), len(modes)
    runs = {k: [] for k in modes}
    counts = {k: [] for k in modes if k}
    for repeat in range(args.repeats):
        for k in (modes if repeat % 2 == 0 else list(reversed(modes))):
            run, token_ids, run_counts = run_once(llms[k], prompts, args.max_tokens)
            run["outputs_identical"] = token_ids == reference
            num_identical += run["outputs_identical"]
            num_runs += 1
            runs[k].append(run)
            if k:
                counts[k].append(run_counts)
            print(f"batch {batch_size:3d} repeat {repeat}: {mode_name(k):>3} {run['wall_s']:7.3f} s "
                  f"{run['output_tokens_per_s']:8.1f} tok/s, {run['num_steps']} steps of {run['step_ms']:.1f} ms, "
                  f"load {run['loadavg_1min']:.2f}", file=sys.stderr)
    result = dict(batch_size=batch_size, distinct_token_share=distinct_token_share(reference),
                  **{mode_name(k): summarize(runs[k]) for k in modes})
    off = result["off"]
    speculative = []
    for k in modes[1:]:
        on = result[mode_name(k)]
        speculative.append(dict(
            num_speculative_tokens=k,
            ratio_on_off=on["median_output_tokens_per_s"] / off["median_output_tokens_per_s"],
            # each repeat runs every mode back to back, so its own ratio sees the same neighbours
            ratio_per_repeat=[n["output_tokens_per_s"] / f["output_tokens_per_s"] for f, n in zip(runs[0], runs[k])],
            step_ratio_on_off=on["median_step_ms"] / off["median_step_ms"],  # a verify step's time / a decode step's
            acceptance=acceptance(_sum_counts(counts[k])),
        ))
    result.update(speculative=speculative, outputs_identical=num_identical == num_runs,
                  num_runs_identical=num_identical, num_runs=num_runs)
    return result


# ------------------------------------------------------------------------------------------- report
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results/speculative_bench.json", help="JSON result path")
    parser.add_argument("--model", default=None,
                        help="HF checkpoint directory (default: build the random llama described above)")
    parser.add_argument("--draft-layers", type=int, default=DRAFT_LAYERS, help="layers of the truncated draft")
    parser.add_argument("--late-layer-scale", type=float, default=0.05,
                        help="built target only: scale of o_proj / down_proj of the layers after the first "
                        "(1: a plain random llama)")
    parser.add_argument("--num-speculative-tokens", default="2,4", help="comma-separated K values")
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode and batch size")
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--intermediate-size", type=int, default=2816)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=2048,
                        help="the model's vocabulary (the built-in BPE tokenizer's ids plus unused ones)")
    parser.add_argument("--max-batch-input-tokens", type=int, default=512, help="Tandem max_batch_input_tokens")
    parser.add_argument("--cost-context-len", type=int, default=64, help="tokens before the timed forwards")
    parser.add_argument("--cost-reps", type=int, default=30, help="timed rounds of the direct forwards")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads for everything (default: every core)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model, batch 1,2, K 2, 8 tokens, 1 repeat: checks the script, measures nothing")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    if args.repeats < 1 or args.cost_reps < 1:
        parser.error("--repeats and --cost-reps must be at least 1")
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",") if b.strip()]
    args.ks = sorted({int(k) for k in str(args.num_speculative_tokens).split(",") if k.strip()})
    if not args.ks or min(args.ks) < 1:
        parser.error("--num-speculative-tokens: one or more K >= 1")
    return args


def measure_all(args) -> tuple[dict, list[dict]]:
    with tempfile.TemporaryDirectory(prefix="spec-bench-") as tmp:
        target, draft, built = build_models(args, Path(tmp))
        config = json.loads((Path(target) / "config.json").read_text())
        models = dict(
            target=dict(path=args.model or "random llama (temporary)", is_random=args.model is None,
                        **{key: config.get(key) for key in SIZE_KEYS}, **built),
            draft=dict(kind="truncated_copy", num_hidden_layers=args.draft_layers),
            dtype="float32", device="cpu",
        )
        llms = {k: make_llm(target, draft, k, args) for k in [0, *args.ks]}
        try:
            results = []
            for batch_size in args.batch_sizes:
                result = measure_throughput(llms, batch_size, args)
                result["costs"] = measure_costs(llms[max(args.ks)], batch_size, args)
                add_predictions(result)
                results.append(result)
        finally:
            del llms
    return models, results


def make_report(args, models: dict, results: list[dict], loadavg_start: float) -> dict:
    return dict(
        benchmark="speculative",
        model=models,
        workload=dict(batch_sizes=args.batch_sizes, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                      seed=args.seed, sampling="greedy (temperature 0), ignore_eos"),
        settings=dict(
            num_speculative_tokens=args.ks, repeats=args.repeats, quick=args.quick, threads=torch.get_num_threads(),
            page_size=PAGE_SIZE, max_batch_input_tokens=args.max_batch_input_tokens, kernel_backend="torch",
            cost_context_len=args.cost_context_len, cost_reps=args.cost_reps,
            date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            loadavg_1min_start=loadavg_start, loadavg_1min_end=_loadavg(),
        ),
        machine=machine_info(torch.get_num_threads()),
        outputs_identical=all(r["outputs_identical"] for r in results),
        results=results,
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    loadavg_start = _loadavg()
    try:
        report = make_report(args, *measure_all(args), loadavg_start)
    finally:
        torch.set_num_threads(previous_threads)  # called in-process (the test), the caller keeps its threads
    for r in report["results"]:
        costs = r["costs"]
        for s in r["speculative"]:
            print(f"batch {r['batch_size']:3d} K={s['num_speculative_tokens']}: on / off = {s['ratio_on_off']:.2f}x "
                  f"(predicted {s['predicted_speedup']:.2f}x), acceptance {s['acceptance']['acceptance_rate']:.2f}, "
                  f"{s['acceptance']['mean_acceptance_length']:.2f} tokens per verify, verify cost "
                  f"{s['verify_cost_ratio']:.2f} steps, draft step {costs['draft_step_ratio']:.2f}", file=sys.stderr)
    if not report["outputs_identical"]:
        bad = [r["batch_size"] for r in report["results"] if not r["outputs_identical"]]
        print(f"OUTPUTS DIFFER between speculation off and on (batch sizes {bad}): greedy speculative decoding "
              "must be exact, this is a bug", file=sys.stderr)
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
