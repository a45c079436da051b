"""Prompt attention on this CPU: the native kernel against torch's flash attention over the gathered pages,
the two paths between which ``kernels/cpu_paged_attention.py`` chooses by the CPU's flags (AMX: torch's from
``FLASH_MIN_QUERY_ROWS`` query rows)::

    python -m bench.cpu_prompt_attention --threads 1 --out bench/results/cpu_prompt_attention.json

Each chunk (query rows over a cached prefix of 0 or more keys), bf16, the benchmark model's heads (8 query /
4 KV heads of 64, pages of 16 in shuffled order), runs through ``paged_attention_cpu`` with the route forced
each way, the two alternating, the median of the repeats kept; their outputs are compared. The report gives
ns per visible query-key pair, and the smallest row count from which torch's path was the faster for every
chunk measured: what ``TANDEM_CPU_FLASH_MIN_QUERY_ROWS`` should say on this machine (``off``: never).
Writes the JSON and a plot beside it (``bench/plot.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROWS = (16, 32, 64, 128, 256, 512, 1024)
PREFIXES = (0, 1024)
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 8, 4, 64, 16


def chunk_inputs(rows: int, prefix: int, dtype: torch.dtype, generator: torch.Generator):
    """One sequence's ``rows`` queries at the end of ``prefix + rows`` keys in shuffled pages."""
    keys = prefix + rows
    num_pages = -(-keys // PAGE_SIZE)
    shape = (num_pages + 4, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    block_table = torch.randperm(num_pages + 4, generator=generator)[:num_pages].to(torch.int32)[None]
    query = torch.randn(rows, NUM_Q_HEADS, HEAD_DIM, generator=generator).to(dtype)
    cu_seqlens_q = torch.tensor([0, rows], dtype=torch.int32)
    context_lens = torch.tensor([keys], dtype=torch.int32)
    return query, k_cache, v_cache, cu_seqlens_q, context_lens, block_table, HEAD_DIM ** -0.5


def visible_pairs(rows: int, prefix: int) -> int:
    """Query-key pairs a causal chunk computes, over every query head."""
    return NUM_Q_HEADS * (rows * prefix + rows * (rows + 1) // 2)


def time_both(inputs, repeats: int) -> tuple[list[float], list[float], float]:
    """Seconds per call of the native path and of torch's, alternating, and their largest output difference."""
    from kernels import cpu_paged_attention

    def run(route: int | None) -> tuple[float, torch.Tensor]:
        cpu_paged_attention.FLASH_MIN_QUERY_ROWS = route
        started = time.perf_counter()
        out = cpu_paged_attention.paged_attention_cpu(*inputs)
        return time.perf_counter() - started, out

    chosen = cpu_paged_attention.FLASH_MIN_QUERY_ROWS
    try:
        native_out, torch_out = run(None)[1], run(1)[1]  # warm-up, and the outputs compared
        native_s, torch_s = [], []
        for _ in range(repeats):
            native_s.append(run(None)[0])
            torch_s.append(run(1)[0])
    finally:
        cpu_paged_attention.FLASH_MIN_QUERY_ROWS = chosen
    return native_s, torch_s, (native_out.float() - torch_out.float()).abs().max().item()


def crossover(cases: list[dict]) -> int | None:
    """The smallest row count from which torch's path was faster for every chunk of that many rows or more."""
    for rows in sorted({case["rows"] for case in cases}):
        if all(case["torch_ns_per_pair"] < case["native_ns_per_pair"] for case in cases if case["rows"] >= rows):
            return rows
    return None


def cpu_description() -> dict:
    from bench.serve_compare import cpu_model
    from kernels import cpu_native

    flags = cpu_native.cpu_flags()
    return {"model": cpu_model(), "amx_bf16": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "native": cpu_native.describe()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--prefixes", type=int, nargs="+", default=list(PREFIXES))
    parser.add_argument("--out", type=Path, default=Path("bench/results/cpu_prompt_attention.json"))
    args = parser.parse_args(argv)

    from kernels import cpu_native, cpu_paged_attention

    if cpu_native.ops is None:
        print("bench.cpu_prompt_attention: the native kernels are not built (pip install -e .)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    cases = []
    for prefix in args.prefixes:
        for rows in args.rows:
            native_s, torch_s, max_diff = time_both(chunk_inputs(rows, prefix, torch.bfloat16, generator),
                                                    args.repeats)
            pairs = visible_pairs(rows, prefix)
            case = {"rows": rows, "prefix": prefix, "pairs": pairs, "native_s": native_s, "torch_s": torch_s,
                    "native_ns_per_pair": statistics.median(native_s) / pairs * 1e9,
                    "torch_ns_per_pair": statistics.median(torch_s) / pairs * 1e9, "max_abs_diff": max_diff}
            cases.append(case)
            print(f"{rows:5d} rows over {prefix:5d} cached keys: native {case['native_ns_per_pair']:.2f}, torch "
                  f"{case['torch_ns_per_pair']:.2f} ns per pair (max diff {max_diff:.3g})", flush=True)
    best = crossover(cases)
    report = {"benchmark": "prompt_attention", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "threads": args.threads,
              "cpu": cpu_description(), "dtype": "bfloat16",
              "shape": {"num_q_heads": NUM_Q_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                        "page_size": PAGE_SIZE},
              "route_chosen": cpu_paged_attention.describe_prompt_route(), "torch_faster_from_rows": best,
              "cases": cases}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"this machine routes: {report['route_chosen']}; torch's path was faster from "
          f"{best if best is not None else 'no'} rows (TANDEM_CPU_FLASH_MIN_QUERY_ROWS={best or 'off'})")
    print(f"wrote {args.out}")
    from bench.plot import render

    print(f"wrote {render(report, args.out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
