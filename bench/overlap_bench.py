"""Overlap scheduler: decode throughput with ``enable_overlap_scheduler`` off and on, and where a step's time goes.

The model is a small random-weight llama (default hidden 128, 2 layers, fp32, CPU), sized so a step
takes about half a millisecond at batch 1 and a few at batch 64, and the host's part of it (scheduling,
building the step's input tensors, stop checks) is over a tenth of an overlap-off step at both; with
hidden 256 and 4 layers it is nearer a twentieth, too little for overlap to show. For each batch size
the same seeded random prompts run greedy with EOS ignored, each producing exactly ``--max-tokens``:

- one warm-up ``generate`` per mode, then ``--repeats`` timed ones; modes alternate within each
  repeat (off, on, off, on, ...) so a noisy neighbour hits both alike. Throughput is output tokens
  over the ``generate`` wall time (prefill included; it is a small part of the run).
- every run's token ids are compared with the first overlap-off run's: ``outputs_identical``. The
  overlap pipeline must not change a token, so this is a check, not a statistic.
- one more overlap-off run is profiled: the engine's host and compute methods are wrapped with
  timers (on the instances, restored afterwards) and reported per step. Overlap can hide at most the
  host share of a step behind the compute. On CPU "compute" includes the model's own Python code
  (module calls, argument parsing), which holds the GIL as the host thread's work does; only the time
  inside torch ops runs beside the host, so the real ceiling is lower.

Usage::

    python -m bench.overlap_bench --out bench/results/overlap_bench.json   # then: python -m bench.plot FILE
    python -m bench.overlap_bench --quick --out /tmp/overlap.json          # seconds: the test's settings
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.offline_throughput import _loadavg, machine_info, write_report

MODES = {"off": False, "on": True}  # report key -> enable_overlap_scheduler
PAGE_SIZE = 16
NUM_HEADS = 4
QUICK = dict(batch_sizes="1,4", max_tokens=16, repeats=1, hidden_size=64, num_layers=2, vocab_size=512)

# Profiled methods, as paths from the LLM. Host phases run on the host thread (what overlap can hide);
# compute phases are the model and the sampler's kernels (what it hides the host behind).
HOST_PHASES = {
    "schedule": "engine.scheduler.schedule",
    "prepare_inputs": "engine.runner.prepare",
    "sampling_plan": "engine.runner.sampler.plan",
    "scheduler_update": "engine.scheduler.update",
    "emit": "engine._emit",
}
COMPUTE_PHASES = {
    "forward": "engine.runner.model.forward",
    "compute_logits": "engine.runner.model.compute_logits",
    "sample": "engine.runner.sampler.sample",
}
STEP = "engine.step"
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads")


def model_config(args) -> dict:
    """Llama shape from the flags: 4 query heads sharing 2 KV heads, SwiGLU width ~8/3 of hidden.

    The built-in corpus trains a BPE tokenizer of only ~570 tokens whatever size is asked for, so the
    model's vocabulary is set to ``--vocab-size`` itself: the tokenizer's ids plus unused ones, as
    real checkpoints pad theirs (the logits and the sampler then cost what that vocabulary costs).
    """
    if args.hidden_size % NUM_HEADS:
        raise SystemExit(f"--hidden-size must be a multiple of {NUM_HEADS} (got {args.hidden_size})")
    return dict(
        tokenizer_vocab_size=args.vocab_size, vocab_size=args.vocab_size, hidden_size=args.hidden_size,
        intermediate_size=-(-args.hidden_size * 8 // 3 // 16) * 16, num_hidden_layers=args.num_layers,
        num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_HEADS // 2,
        max_position_embeddings=max(2048, args.prompt_len + args.max_tokens), initializer_range=0.05,
    )


def make_llm(model_path: str, batch_size: int, is_overlap: bool, args):
    """An engine whose KV pool holds the whole batch at full length: nothing is preempted."""
    from pipeline import LLM

    blocks_per_request = -(-(args.prompt_len + args.max_tokens + 1) // PAGE_SIZE)
    return LLM(
        model=model_path, model_config={"dtype": "float32", "device": "cpu"}, kernel_backend="torch",
        enable_overlap_scheduler=is_overlap, max_batch_size=batch_size,
        max_batch_input_tokens=args.max_batch_input_tokens,
        kv_cache={"page_size": PAGE_SIZE, "num_blocks": batch_size * blocks_per_request + 2},
    )


def make_prompts(llm, batch_size: int, args) -> list[list[int]]:
    """Seeded prompts of ordinary (non-special) token ids, no shared prefixes."""
    rng = random.Random(args.seed + batch_size)
    specials = set(llm.tokenizer.all_special_ids)
    ordinary = [t for t in range(llm.engine.vocab_size) if t not in specials]
    return [[rng.choice(ordinary) for _ in range(args.prompt_len)] for _ in range(batch_size)]


def run_once(llm, prompts: list[list[int]], max_tokens: int) -> tuple[dict, list[list[int]]]:
    from pipeline import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.engine.kv_manager.reset_prefix_cache()  # each run prefills its prompts again, in both modes
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    num_tokens = sum(len(o.token_ids) for o in outputs)
    if num_tokens != len(prompts) * max_tokens:
        raise RuntimeError(f"got {num_tokens} output tokens, asked for {len(prompts) * max_tokens}")
    run = dict(wall_s=wall, output_tokens=num_tokens, output_tokens_per_s=num_tokens / wall, loadavg_1min=_loadavg())
    return run, [list(o.token_ids) for o in outputs]


# ----------------------------------------------------------------------------------------- profile
def _resolve(root, path: str):
    """(object, attribute name) for a dotted ``path`` from ``root``, or None where a name is missing."""
    *parents, name = path.split(".")[1:]  # the leading "engine" is ``root``
    owner = root
    for part in parents:
        owner = getattr(owner, part, None)
    return (owner, name) if owner is not None and callable(getattr(owner, name, None)) else None


@contextmanager
def timed_methods(engine, paths: dict[str, str]):
    """Wrap each method with a perf_counter accumulator on its instance; yields (seconds, calls, missing).

    A wrapper shadows the class's method only on that object (an ``nn.Module``'s ``forward`` too, as
    ``Module.__call__`` reads ``self.forward``) and is removed on exit. A path that names nothing (a
    method renamed) is listed as missing rather than failing the benchmark.
    """
    seconds = dict.fromkeys(paths, 0.0)
    calls = dict.fromkeys(paths, 0)
    missing, patched = [], []
    for key, path in paths.items():
        found = _resolve(engine, path)
        if found is None:
            missing.append(path)
            continue
        owner, name = found
        original = getattr(owner, name)

        def timed(*args, _original=original, _key=key, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                seconds[_key] += time.perf_counter() - start
                calls[_key] += 1

        patched.append((owner, name, name in vars(owner), vars(owner).get(name)))
        setattr(owner, name, timed)
    try:
        yield seconds, calls, missing
    finally:
        for owner, name, had_own, own in reversed(patched):
            if had_own:
                setattr(owner, name, own)
            else:
                delattr(owner, name)


def profile_steps(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """Per-step means (µs) and shares of the step for each phase of one overlap-off run."""
    paths = {**HOST_PHASES, **COMPUTE_PHASES, "step": STEP}
    with timed_methods(llm.engine, paths) as (seconds, calls, missing):
        run, _ = run_once(llm, prompts, max_tokens)
    num_steps = calls["step"]
    profile = dict(num_steps=num_steps, wall_s=run["wall_s"], missing=missing, phases={})
    if STEP in missing or num_steps == 0:
        return profile
    step_s = seconds["step"]
    compute_s = sum(seconds[k] for k in COMPUTE_PHASES)
    for key in [*HOST_PHASES, *COMPUTE_PHASES]:
        if paths[key] not in missing:
            profile["phases"][key] = dict(
                kind="host" if key in HOST_PHASES else "compute", calls=calls[key],
                us_per_step=1e6 * seconds[key] / num_steps, share_of_step=seconds[key] / step_s)
    other_host_s = step_s - sum(seconds[k] for k in [*HOST_PHASES, *COMPUTE_PHASES])
    profile["phases"]["other_host"] = dict(  # inside step() but in no wrapped method: seeding, indexing, loops
        kind="host", calls=num_steps, us_per_step=1e6 * other_host_s / num_steps, share_of_step=other_host_s / step_s)
    profile.update(
        step_us=1e6 * step_s / num_steps,
        host_us_per_step=1e6 * (step_s - compute_s) / num_steps,
        compute_us_per_step=1e6 * compute_s / num_steps,
        host_share=(step_s - compute_s) / step_s,
        outside_step_us_per_step=1e6 * (run["wall_s"] - step_s) / num_steps,  # generate()'s own loop
    )
    return profile


# ------------------------------------------------------------------------------------------ measure
def summarize(runs: list[dict]) -> dict:
    return dict(median_output_tokens_per_s=statistics.median(r["output_tokens_per_s"] for r in runs),
                median_wall_s=statistics.median(r["wall_s"] for r in runs), runs=runs)


def measure_batch(model_path: str, batch_size: int, args) -> dict:
    """Both modes on ``batch_size`` prompts: timed repeats (alternating), the token check, the profile."""
    llms = {mode: make_llm(model_path, batch_size, is_overlap, args) for mode, is_overlap in MODES.items()}
    try:
        prompts = make_prompts(llms["off"], batch_size, args)
        warmup_tokens = {mode: run_once(llms[mode], prompts, args.max_tokens)[1] for mode in MODES}
        reference = warmup_tokens["off"]  # every run, warm-ups included, must give these tokens
        num_identical, num_runs = sum(t == reference for t in warmup_tokens.values()), len(MODES)
        runs = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            order = list(MODES) if repeat % 2 == 0 else list(reversed(MODES))
            for mode in order:
                run, token_ids = run_once(llms[mode], prompts, args.max_tokens)
                num_identical += token_ids == reference
                num_runs += 1
                runs[mode].append(run)
                print(f"batch {batch_size:3d} repeat {repeat}: overlap {mode:>3} {run['wall_s']:7.3f} s "
                      f"{run['output_tokens_per_s']:9.1f} tok/s", file=sys.stderr)
        profile = profile_steps(llms["off"], prompts, args.max_tokens)
    finally:
        for llm in llms.values():
            if getattr(llm.engine, "stream", None) is not None:
                llm.engine.stream.close()
    result = {mode: summarize(runs[mode]) for mode in MODES}
    result.update(
        batch_size=batch_size,
        ratio_on_off=result["on"]["median_output_tokens_per_s"] / result["off"]["median_output_tokens_per_s"],
        # Each repeat runs both modes back to back, so its own ratio sees the same neighbours.
        ratio_per_repeat=[n["output_tokens_per_s"] / f["output_tokens_per_s"] for f, n in zip(runs["off"], runs["on"])],
        outputs_identical=num_identical == num_runs, num_runs_identical=num_identical, num_runs=num_runs,
        profile_overlap_off=profile,
    )
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results/overlap_bench.json", help="JSON result path")
    parser.add_argument("--model", default=None, help="HF checkpoint directory (default: build a small random llama)")
    parser.add_argument("--batch-sizes", default="1,64", help="comma-separated")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per mode and batch size")
    parser.add_argument("--hidden-size", type=int, default=128, help="random model without --model")
    parser.add_argument("--num-layers", type=int, default=2, help="random model without --model")
    parser.add_argument("--vocab-size", type=int, default=2048, help="random model's vocabulary")
    parser.add_argument("--max-batch-input-tokens", type=int, default=512, help="Tandem max_batch_input_tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch threads for the model (default 1: the host thread then has the other cores to itself, "
        "and OpenMP threads waiting on a core a neighbour holds would measure the neighbour)")
    parser.add_argument("--quick", action="store_true",
                        help="batch 1,4, 16 tokens, 1 repeat, a tiny model: checks the script, measures nothing")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",") if b.strip()]
    return args


def measure_all(args) -> tuple[dict, list[dict]]:
    """The model's sizes (from its config.json, ``--model`` or built) and one result per batch size."""
    with tempfile.TemporaryDirectory(prefix="overlap-bench-") as tmp:
        model_path = args.model
        if model_path is None:
            from pipeline.builtin_model import build_checkpoint

            model_path = str(build_checkpoint(Path(tmp) / "model", "llama", seed=0, **model_config(args)))
        hf_config = json.loads((Path(model_path) / "config.json").read_text())
        sizes = {key: hf_config.get(key) for key in SIZE_KEYS}
        return sizes, [measure_batch(model_path, batch_size, args) for batch_size in args.batch_sizes]


def make_report(args, sizes: dict, results: list[dict]) -> dict:
    return dict(
        benchmark="overlap",
        model=dict(path=args.model or "random llama (temporary)", is_random=args.model is None, dtype="float32",
                   device="cpu", **sizes),
        workload=dict(batch_sizes=args.batch_sizes, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                      seed=args.seed, sampling="greedy (temperature 0), ignore_eos"),
        settings=dict(
            repeats=args.repeats, quick=args.quick, threads=torch.get_num_threads(), page_size=PAGE_SIZE,
            max_batch_input_tokens=args.max_batch_input_tokens, kernel_backend="torch",
            date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        ),
        machine=machine_info(torch.get_num_threads()),
        outputs_identical=all(r["outputs_identical"] for r in results),
        results=results,
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        report = make_report(args, *measure_all(args))
    finally:
        torch.set_num_threads(previous_threads)  # called in-process (the test), the caller keeps its threads
    for r in report["results"]:
        print(f"batch {r['batch_size']:3d}: on / off = {r['ratio_on_off']:.2f}x, host share (off) "
              f"{r['profile_overlap_off'].get('host_share', float('nan')):.0%}, outputs identical: "
              f"{r['outputs_identical']}", file=sys.stderr)
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
