"""Structured output: what a grammar costs per decode step, at a realistic vocabulary (~32k tokens).

A constrained request costs the engine, every decode step, three things on top of an ordinary one
(``pipeline/sampling_metadata.py`` ``_grammar_bitmask`` and ``pipeline/sampler.py``):

- **fill**: a zeroed packed int32 bitmask [batch, ceil(vocab / 32)] is allocated and each request's
  matcher writes its allowed next tokens into its row: on the host, one row after another, so it grows
  with the batch, and each row walks the grammar against the whole vocabulary.
- **accept**: each matcher advances by the token the request sampled.
- **apply**: ``pipeline.sampler.apply_bitmask`` sets the disallowed logits of [batch, vocab] fp32 to
  -inf (and, for comparison, llguidance's own ``apply_token_bitmask_inplace``, a ``torch.compile``d
  kernel, when installed).

No model runs. The vocabulary is real, though: a byte-level BPE tokenizer of ``--vocab-size`` tokens
(default 32000, a Llama-2-sized vocabulary) is trained here on the Python standard library's own
.py/.txt files (no network), since a mask's cost depends on how many tokens there are and how much
they share prefixes, which a toy tokenizer of a few hundred tokens would not show. The grammar is a
realistic JSON schema (``SCHEMA``: nested object, strings, integers, enums, arrays), and "sampled"
tokens are the tokens of valid documents for it (``make_documents``, EOS at the end): each of the batch's
matchers starts at a different point inside one of them, so the masks differ from row to row as in a
real batch. When a document ends (EOS accepted) its row starts over on a fresh matcher, untimed: that is
a new request, not a step.

Every mask filled is checked (untimed) against the document: it must allow the document's next token,
and every accept must succeed. ``masks_allow_document`` is true only when no mask and no accept failed
(a backend that rejected valid output would fail requests). Grammar compile time is measured per backend
on a fresh backend: the first ``backend.matcher(spec)`` (compile), then later ones (cached grammar).

For scale, the report quotes the step time of an overlap-off decode step at batch 64 from
``bench/results/overlap_bench.json`` when it exists (a tiny model with a 2048-token vocabulary, so a
32k-vocabulary model's step would be longer): ``fill_share_of_reference_step`` is fill / that step.
Timings run on ``--threads`` torch threads (default 1, as the engine's host work); the machine's load
average at the start and end is in ``settings``, since a busy neighbour shows up in the p90s first.

Usage::

    python -m bench.structured_output_bench --out bench/results/structured_output_bench.json
    python -m bench.plot bench/results/structured_output_bench.json
    python -m bench.structured_output_bench --quick --out /tmp/so.json   # seconds: the test's settings
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
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from bench.local_tokenizer import build_local_tokenizer
from bench.offline_throughput import _loadavg, machine_info, write_report
from bench.structured_output_documents import SCHEMA, make_documents
from pipeline.structured_output.backend import fill_bitmasks

QUICK = dict(vocab_size=2000, batch_sizes="1,4", steps=5, warmup=1, backends="llguidance", corpus_mb=1.0,
             llguidance_apply=False)
REFERENCE_REPORT = Path(__file__).parent / "results" / "overlap_bench.json"
REFERENCE_BATCH = 64

# ----------------------------------------------------------------------------------------- backends
def spec_for_schema():
    from pipeline.protocol import StructuredOutput

    return StructuredOutput(kind="json", value=json.dumps(SCHEMA))


def try_backend(name: str, tokenizer, vocab_size: int):
    """(backend, None), or (None, why not): a backend that is not there yet is recorded, not fatal."""
    from pipeline.structured_output.backend import make_backend

    try:
        return make_backend(name, tokenizer, vocab_size), None
    except Exception as exc:  # noqa: BLE001 - unknown backend, missing package: either way, not measured
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def measure_compile(name: str, tokenizer, vocab_size: int, spec, repeats: int = 5) -> dict:
    """Backend construction, the first ``matcher(spec)`` (compiles) and later ones (cached), on a fresh backend
    warmed on a trivial regex first (so imports and tokenizer set-up are not counted as the schema's).

    Each matcher's first mask is timed too: a backend may build parts of its grammar lazily, on the
    first mask, and a request's first decode step pays for that whichever call it lands in."""
    from pipeline.protocol import StructuredOutput

    start = time.perf_counter()
    backend, _ = try_backend(name, tokenizer, vocab_size)
    init_ms = (time.perf_counter() - start) * 1e3
    bitmask = torch.zeros(1, -(-vocab_size // 32), dtype=torch.int32)
    start = time.perf_counter()  # lazy imports and per-tokenizer set-up: paid once per engine, not per schema
    backend.matcher(StructuredOutput(kind="regex", value="[0-9]+")).fill_bitmask(bitmask, 0)
    warmup_ms = (time.perf_counter() - start) * 1e3
    matcher_ms, mask_ms = [], []
    for _ in range(1 + repeats):
        start = time.perf_counter()
        matcher = backend.matcher(spec)
        matcher_ms.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        matcher.fill_bitmask(bitmask, 0)
        mask_ms.append((time.perf_counter() - start) * 1e3)
    return dict(backend_init_ms=init_ms, backend_warmup_ms=warmup_ms,
                first_matcher_ms=matcher_ms[0], first_matcher_first_mask_ms=mask_ms[0],
                cached_matcher_ms=statistics.median(matcher_ms[1:]),
                cached_matcher_first_mask_ms=statistics.median(mask_ms[1:]), cached_matcher_runs_ms=matcher_ms[1:])


# -------------------------------------------------------------------------------------------- steps
@dataclass
class Row:
    """One request: its matcher, the document it is writing and the index of its next token."""
    matcher: object
    document: list[int]
    position: int


def start_rows(backend, spec, documents: list[list[int]], batch_size: int, seed: int) -> tuple[list[Row], int]:
    """``batch_size`` matchers, row i on document i % len(documents), advanced to a seeded random prefix.

    Returns the rows and how many prefix tokens the matchers refused (0 unless the backend is wrong)."""
    rng = random.Random(seed * 1000 + batch_size)
    rows, rejected = [], 0
    for i in range(batch_size):
        document = documents[i % len(documents)]
        row = Row(backend.matcher(spec), document, rng.randrange(len(document)))
        rejected += sum(not row.matcher.accept(t) for t in document[: row.position])
        rows.append(row)
    return rows, rejected


def next_tokens(rows: list[Row]) -> torch.Tensor:
    return torch.tensor([r.document[r.position] for r in rows], dtype=torch.int64)  # [batch]


def check_masks(bitmask: torch.Tensor, tokens: torch.Tensor) -> dict:
    """Per row: is the mask non-empty, does it allow ``tokens`` [batch], and how many tokens it allows."""
    rows = torch.arange(len(tokens))
    is_allowed = ((bitmask[rows, tokens // 32] >> (tokens % 32).to(torch.int32)) & 1).bool()  # [batch]
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [batch, words, 32]
    return dict(is_allowed=is_allowed, allowed_counts=bits.sum(dim=(1, 2)),
                distinct=int(torch.unique(bitmask, dim=0).shape[0]))


def llguidance_apply():
    """llguidance's own in-place mask kernel, or None where it is not installed."""
    try:
        from llguidance.torch import apply_token_bitmask_inplace
    except ImportError:
        return None
    return apply_token_bitmask_inplace


def run_steps(backend, spec, rows: list[Row], vocab_size: int, args, llg_apply) -> dict:
    """``args.warmup`` untimed steps, then ``args.steps`` timed ones: fill, check (untimed), accept, apply."""
    from pipeline.sampler import apply_bitmask

    batch_size = len(rows)
    words = -(-vocab_size // 32)
    logits = torch.randn(batch_size, vocab_size, generator=torch.Generator().manual_seed(0))  # [batch, vocab]
    times: dict[str, list[float]] = {"fill": [], "accept": [], "apply": []}
    if llg_apply is not None:
        times["apply_llguidance"] = []
    checked = not_allowed = empty = rejected = resets = 0
    allowed_counts: list[int] = []
    distinct: list[int] = []
    apply_agree = True
    for step in range(args.warmup + args.steps):
        is_timed = step >= args.warmup
        tokens = next_tokens(rows)
        token_list = tokens.tolist()  # plain ints, as the engine has them: no tensor indexing in the accept timing

        start = time.perf_counter_ns()
        bitmask = torch.zeros(batch_size, words, dtype=torch.int32)  # as _grammar_bitmask: fresh each step
        fill_bitmasks([row.matcher for row in rows], bitmask)  # the engine's call (batched when it can be)
        fill_ns = time.perf_counter_ns() - start

        check = check_masks(bitmask, tokens)
        checked += batch_size
        not_allowed += int((~check["is_allowed"]).sum())
        empty += int((check["allowed_counts"] == 0).sum())
        allowed_counts += check["allowed_counts"].tolist()
        distinct.append(check["distinct"])

        start = time.perf_counter_ns()
        accepted = [row.matcher.accept(t) for row, t in zip(rows, token_list)]
        accept_ns = time.perf_counter_ns() - start
        rejected += accepted.count(False)

        start = time.perf_counter_ns()
        masked = apply_bitmask(logits, bitmask)
        apply_ns = time.perf_counter_ns() - start
        if llg_apply is not None:
            inplace = logits.clone()
            start = time.perf_counter_ns()
            llg_apply(inplace, bitmask)
            llg_ns = time.perf_counter_ns() - start
            apply_agree &= bool(torch.equal(torch.isinf(inplace), torch.isinf(masked)))
            if is_timed:
                times["apply_llguidance"].append(llg_ns / 1e3)
        if is_timed:
            times["fill"].append(fill_ns / 1e3)
            times["accept"].append(accept_ns / 1e3)
            times["apply"].append(apply_ns / 1e3)

        for i, (row, ok) in enumerate(zip(rows, accepted)):
            row.position += 1
            if row.position == len(row.document) or not ok:  # document done (or matcher broken): a new request
                rows[i] = Row(backend.matcher(spec), row.document, 0)
                resets += 1
    result = {part: summarize_us(samples) for part, samples in times.items()}
    result["fill"]["median_us_per_row"] = result["fill"]["median_us"] / batch_size
    result.update(
        masks_checked=checked, masks_empty=empty, masks_not_allowing_document=not_allowed, accepts_rejected=rejected,
        masks_allow_document=checked > 0 and empty == not_allowed == rejected == 0,
        allowed_tokens_median=statistics.median(allowed_counts), allowed_tokens_p90=_p90(allowed_counts),
        allowed_tokens_max=max(allowed_counts), distinct_masks_per_step_median=statistics.median(distinct),
        documents_restarted=resets,
    )
    if llg_apply is not None:
        result["apply_llguidance_agrees"] = apply_agree
    return result


def summarize_us(samples: list[float]) -> dict:
    """Median and p90 in µs, and the samples."""
    return dict(median_us=statistics.median(samples), p90_us=_p90(samples), samples_us=[round(s, 2) for s in samples])


def _p90(values: list[float]) -> float:
    """Inclusive quantiles: defined for any number of values, and never past the largest."""
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]


def warm_llguidance_apply(llg_apply, vocab_size: int, batch_sizes: list[int]) -> dict:
    """Compile llguidance's kernel once per batch size before any timing (``torch.compile``: seconds on CPU)."""
    compile_s = {}
    for batch_size in batch_sizes:
        start = time.perf_counter()
        bitmask = torch.full((batch_size, -(-vocab_size // 32)), -1, dtype=torch.int32)
        llg_apply(torch.zeros(batch_size, vocab_size), bitmask)
        compile_s[str(batch_size)] = time.perf_counter() - start
    return compile_s


# --------------------------------------------------------------------------------------------- report
def reference_step(path: Path) -> dict | None:
    """The overlap benchmark's overlap-off step at batch 64, if that report exists and has it."""
    try:
        report = json.loads(path.read_text())
        result = next(r for r in report["results"] if r["batch_size"] == REFERENCE_BATCH)
        step_us = float(result["profile_overlap_off"]["step_us"])
    except (OSError, ValueError, KeyError, StopIteration, TypeError):
        return None
    model = report.get("model", {})
    return dict(source=str(path), batch_size=REFERENCE_BATCH, step_us=step_us, model=model,
                date=report.get("settings", {}).get("date"),
                note=(f"an overlap-off decode step of the overlap benchmark's model (vocab {model.get('vocab_size')}, "
                      f"hidden {model.get('hidden_size')}, {model.get('num_hidden_layers')} layers, CPU): a scale, "
                      "not the step of a model with this vocabulary"))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results/structured_output_bench.json", help="JSON result path")
    parser.add_argument("--vocab-size", type=int, default=32000, help="BPE vocabulary to train")
    parser.add_argument("--corpus-mb", type=float, default=16.0, help="stdlib text to train it on (MiB)")
    parser.add_argument("--backends", default="llguidance,xgrammar", help="comma-separated grammar backends")
    parser.add_argument("--batch-sizes", default="1,64", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per backend and batch size")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--documents", type=int, default=8, help="distinct valid documents the rows write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: the engine's host work is single-threaded, and on a "
                        "shared machine extra threads measure the neighbours)")
    parser.add_argument("--no-llguidance-apply", dest="llguidance_apply", action="store_false",
                        help="skip timing llguidance's apply_token_bitmask_inplace (torch.compile: ~15 s on CPU)")
    parser.add_argument("--reference", type=Path, default=REFERENCE_REPORT,
                        help="overlap benchmark report whose batch-64 overlap-off step is the scale")
    parser.add_argument("--quick", action="store_true",
                        help="seconds, for the test: vocab 2000, batch 1,4, 5 steps, llguidance only, "
                        "no compiled apply")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    return args


def measure_backend(name: str, tokenizer, vocab_size: int, documents, args, llg_apply) -> tuple[dict, list[dict]]:
    """Its compile times and one result per batch size, or why it is unavailable."""
    spec = spec_for_schema()
    backend, why_not = try_backend(name, tokenizer, vocab_size)
    if backend is None:
        print(f"{name}: unavailable ({why_not})", file=sys.stderr)
        return dict(available=False, reason=why_not), []
    info = dict(available=True, version=_version(name), compile=measure_compile(name, tokenizer, vocab_size, spec))
    results = []
    for batch_size in args.batch_sizes:
        rows, rejected = start_rows(backend, spec, documents, batch_size, args.seed)
        result = dict(backend=name, batch_size=batch_size, prefix_tokens_rejected=rejected,
                      **run_steps(backend, spec, rows, vocab_size, args, llg_apply))
        result["masks_allow_document"] &= rejected == 0
        results.append(result)
        print(f"{name} batch {batch_size}: fill {result['fill']['median_us']:.0f} µs, accept "
              f"{result['accept']['median_us']:.0f} µs, apply {result['apply']['median_us']:.0f} µs per step "
              f"(median); masks allow the document: {result['masks_allow_document']}", file=sys.stderr)
    return info, results


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main(argv=None) -> dict:
    args = parse_args(argv)
    caller_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    loadavg_start = _loadavg()
    try:
        with tempfile.TemporaryDirectory(prefix="tandem-so-bench-") as tmp:
            tokenizer, tokenizer_info = build_local_tokenizer(args.vocab_size, args.corpus_mb, Path(tmp))
            vocab_size = len(tokenizer)  # the model's vocabulary: no padded tail here
            documents = make_documents(tokenizer, args.documents, args.seed)
            llg_apply = llguidance_apply() if args.llguidance_apply else None
            apply_compile_s = warm_llguidance_apply(llg_apply, vocab_size, args.batch_sizes) if llg_apply else None
            backends, results = {}, []
            for name in args.backends:
                backends[name], measured = measure_backend(name, tokenizer, vocab_size, documents, args, llg_apply)
                results += measured
    finally:
        torch.set_num_threads(caller_threads)
    reference = reference_step(args.reference)
    for result in results:
        if reference and result["batch_size"] == reference["batch_size"]:
            result["fill_share_of_reference_step"] = result["fill"]["median_us"] / reference["step_us"]
    report = dict(
        benchmark="structured_output",
        settings=dict(
            vocab_size=vocab_size, requested_vocab_size=args.vocab_size, steps=args.steps, warmup=args.warmup,
            batch_sizes=args.batch_sizes, backends=args.backends, threads=args.threads, seed=args.seed,
            quick=args.quick, documents=args.documents, logits_dtype="float32",
            date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            loadavg_1min_start=loadavg_start, loadavg_1min_end=_loadavg(),
        ),
        machine=machine_info(args.threads),
        tokenizer=tokenizer_info,
        schema=SCHEMA,
        document_tokens=[len(d) for d in documents],
        backends=backends,
        llguidance_apply=(dict(compile_s_per_batch_size=apply_compile_s) if llg_apply else dict(
            skipped="--quick or --no-llguidance-apply" if llguidance_apply() else "not installed")),
        reference=reference,
        masks_allow_document=bool(results) and all(r["masks_allow_document"] for r in results),
        results=results,
    )
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
