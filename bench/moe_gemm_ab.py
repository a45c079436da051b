"""Same-process A/B of one mixture-of-experts layer's expert GEMMs on the CPU, bf16 (issue 33): the per-expert
packed oneDNN loop (two ``CpuLinear`` calls per expert) against the one-call native path (``kernels/cpu_moe.py``:
all experts' gate/up in one call, SiLU-and-mul, all experts' down in one call), over the same rows grouped by
expert. Prints and writes the medians and the GB/s at which each reads the experts' weights.

    python -m bench.moe_gemm_ab --out bench/results/moe_gemm_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench.memory_bandwidth import timed
from bench.quantization_bench import cpu_description
from kernels import cpu_moe, cpu_native
from kernels.cpu_gemm import CpuLinear
from kernels.cpu_elementwise import silu_and_mul_cpu


def median_ms(fn, repeats: int) -> float:
    return statistics.median(timed(fn, repeats)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--rows", default="1,3,8,16", help="rows per expert, comma-separated")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if not cpu_moe.native_available():
        raise SystemExit("the one-call MoE GEMM does not run here (no AVX512-BF16, or the native module not built)")
    generator = torch.Generator().manual_seed(0)
    num_experts, hidden, inter = args.experts, args.hidden, args.intermediate
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=generator) / hidden**0.5).to(torch.bfloat16)
    down = (torch.randn(num_experts, hidden, inter, generator=generator) / inter**0.5).to(torch.bfloat16)
    weight_bytes = (gate_up.numel() + down.numel()) * 2
    pairs = [(CpuLinear(g, None), CpuLinear(d, None)) for g, d in zip(gate_up, down)]
    grouped_experts = cpu_moe.GroupedExperts(gate_up, down)
    results = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for rows in [int(r) for r in args.rows.split(",")]:
            rows_per_expert = torch.full((num_experts,), rows, dtype=torch.int64)
            grouped = torch.randn(num_experts * rows, hidden, generator=generator).to(torch.bfloat16)

            def per_expert_loop() -> torch.Tensor:
                out = torch.empty_like(grouped)
                for index, (gate_up_gemm, down_gemm) in enumerate(pairs):
                    part = slice(index * rows, (index + 1) * rows)
                    out[part] = down_gemm(silu_and_mul_cpu(gate_up_gemm(grouped[part])))
                return out

            def one_call() -> torch.Tensor:
                return grouped_experts(grouped, rows_per_expert, silu_and_mul_cpu)

            difference = (per_expert_loop().float() - one_call().float()).abs().max().item()
            loop_ms, native_ms = median_ms(per_expert_loop, args.repeats), median_ms(one_call, args.repeats)
            row = {"threads": threads, "rows_per_expert": rows, "loop_ms": round(loop_ms, 3),
                   "native_ms": round(native_ms, 3), "speedup": round(loop_ms / native_ms, 2),
                   "loop_gb_s": round(weight_bytes / loop_ms / 1e6, 1),
                   "native_gb_s": round(weight_bytes / native_ms / 1e6, 1), "max_abs_difference": difference}
            results.append(row)
            print(f"{threads} thread(s), {rows:2d} rows/expert: loop {loop_ms:6.2f} ms ({row['loop_gb_s']:5.1f} GB/s)"
                  f"  one call {native_ms:6.2f} ms ({row['native_gb_s']:5.1f} GB/s)  {row['speedup']:.2f}x"
                  f"  max |diff| {difference:.3g}")
    report = {"cpu": cpu_description(), "kernels": cpu_native.describe(),
              "moe_gemm_body": cpu_native.ops.moe_gemm_isa(), "num_experts": num_experts, "hidden": hidden,
              "intermediate": inter, "weight_mb": round(weight_bytes / 1e6, 1), "results": results}
    if args.out:
        with open(args.out, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
