"""Prompt attention on this CPU: the native kernel against torch's flash attention over the gathered pages,
the two paths between which ``kernels/cpu_paged_attention.py`` chooses (on an AMX CPU: torch's from
``FLASH_MIN_QUERY_ROWS`` query rows, measured at load by ``kernels/cpu_prompt_route.py`` over fewer chunks)::

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

from kernels.cpu_prompt_route import chunk_inputs, crossover, time_both, visible_pairs

ROWS = (16, 32, 64, 128, 256, 512, 1024)
PREFIXES = (0, 1024)
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 8, 4, 64, 16


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
            inputs = chunk_inputs(rows, prefix, torch.bfloat16, generator, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM,
                                  PAGE_SIZE)
            native_s, torch_s, max_diff = time_both(inputs, args.repeats)
            pairs = visible_pairs(rows, prefix, NUM_Q_HEADS)
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
