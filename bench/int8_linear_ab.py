"""A/B of the int8 W8A8 linear on the CPU, same process: the torch code (``int8_product``: quantize in torch
passes, ``torch._int_mm``, rescale in fp32, bias, cast) against ``Int8Linear`` as it runs now (the native
quantize pass and, where the CPU has AVX-512 VNNI, the packed int8 GEMM with the rescale in its epilogue).

TinyLlama-1.1B's four GEMMs (qkv 2048->2560, o 2048->2048, gate_up 2048->11264, down 5632->2048), bf16
activations in and out as the model runs them, for 1, 12 and 256 rows (batch-1 decode, the peer benchmark's
12-request decode step, a prefill chunk) at 1 and 2 threads. Each variant cycles through enough copies of the
layer that their weights (>= 128 MiB) do not stay in the L3 cache between calls, as a model's 22 layers do not;
the variants take turns within each repeat, and each figure is the median over repeats of the time per call.
Nothing asserts a timing. Usage: ``python -m bench.int8_linear_ab --out bench/results/int8_linear_ab.json``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

from bench.quantization_bench import cpu_description
from kernels import cpu_int8, cpu_native
from pipeline.quantization.int8 import Int8Linear, int8_product, quantize_per_row

SHAPES = {"qkv 2048->2560": (2048, 2560), "o 2048->2048": (2048, 2048), "gate_up 2048->11264": (2048, 11264),
          "down 5632->2048": (5632, 2048)}
ROWS = (1, 12, 256)
THREADS = (1, 2)
MIN_WEIGHT_BYTES = 128 << 20


def torch_code(layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """What ``Int8Linear.forward`` computed before the native path (and still computes without it)."""
    out = int8_product(x, layer.weight_t, layer.scale_row, layer.act_scale)
    if layer.bias is not None:
        out = out.add_(layer.bias)
    return out.to(layer.dtype)


def make_layers(in_features: int, out_features: int, generator: torch.Generator) -> list[Int8Linear]:
    count = max(2, math.ceil(MIN_WEIGHT_BYTES / (in_features * out_features)))
    layers = []
    for _ in range(count):
        weight_q, weight_scale = quantize_per_row(torch.randn(out_features, in_features, generator=generator))
        layer = Int8Linear(in_features, [out_features], False, torch.bfloat16, "cpu", is_prequantized=True)
        layer.weight.data.copy_(weight_q)
        layer.weight_scale.data.copy_(weight_scale)
        layer.finish_loading()
        layers.append(layer)
    return layers


def per_call_ms(fns: dict, num_layers: int, repeats: int) -> dict[str, list[float]]:
    """Each function runs once over every layer per repeat (turns within a repeat); ms per layer call."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3 / num_layers)
    return times


@torch.no_grad()
def run(repeats: int, rows_list: tuple[int, ...], threads_list: tuple[int, ...]) -> list[dict]:
    results = []
    generator = torch.Generator().manual_seed(0)
    for shape_name, (in_features, out_features) in SHAPES.items():
        layers = make_layers(in_features, out_features, generator)
        for threads in threads_list:
            torch.set_num_threads(threads)
            for rows in rows_list:
                x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
                assert torch.equal(layers[0](x), torch_code(layers[0], x))  # the same values, bit for bit
                fns = {"old": lambda: [torch_code(layer, x) for layer in layers],
                       "new": lambda: [layer(x) for layer in layers]}
                times = per_call_ms(fns, len(layers), repeats)
                old, new = statistics.median(times["old"]), statistics.median(times["new"])
                entry = {"shape": shape_name, "rows": rows, "threads": threads, "layers_cycled": len(layers),
                         "old_ms": round(old, 4), "new_ms": round(new, 4), "speedup": round(old / new, 2),
                         "new_weight_gb_per_s": round(in_features * out_features / new / 1e6, 1),
                         "new_gops": round(2 * rows * in_features * out_features / new / 1e6, 1),
                         "old_per_repeat": [round(t, 4) for t in times["old"]],
                         "new_per_repeat": [round(t, 4) for t in times["new"]],
                         "load_average_1m": os.getloadavg()[0]}
                results.append(entry)
                print(f"{shape_name:20s} rows {rows:4d} threads {threads}: old {old:8.3f} ms  new {new:8.3f} ms  "
                      f"x{old / new:5.2f}  ({entry['new_weight_gb_per_s']} GB/s, {entry['new_gops']} GOP/s)",
                      flush=True)
        del layers
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--threads", default=",".join(map(str, THREADS)))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = tuple(int(r) for r in args.rows.split(","))
    threads = tuple(int(t) for t in args.threads.split(","))
    report = {"cpu": cpu_description(), "native": cpu_native.describe(),
              "int8_gemm": cpu_native.ops.int8_gemm_isa() if cpu_native.ops is not None else None,
              "packed_gemm_for_all_rows": cpu_int8.packed_gemm_preferred(max(rows)),
              "repeats": args.repeats, "results": run(args.repeats, rows, threads)}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
