"""A/B of the int8 W8A8 linear on the CPU, same process: the torch code (``int8_product``: quantize in torch
passes, ``torch._int_mm``, rescale in fp32, bias, cast) against ``Int8Linear`` as it runs now (the native
quantize pass and, where the CPU has AVX-512 VNNI, the packed int8 GEMM with the rescale in its epilogue).

TinyLlama-1.1B's four GEMMs (qkv 2048->2560, o 2048->2048, gate_up 2048->11264, down 5632->2048), bf16
activations in and out as the model runs them, for 1, 12 and 256 rows (batch-1 decode, the peer benchmark's
12-request decode step, a prefill chunk) at 1 and 2 threads. Each variant cycles through enough copies of the
layer that their weights (>= 128 MiB) do not stay in the L3 cache between calls, as a model's 22 layers do not;
the variants take turns within each repeat, and each figure is the median over repeats of the time per call.
``--offline`` adds the whole model: the peer benchmark's TinyLlama-1.1B W8A8 checkpoint and offline workload
(``bench/peer_compare.py``: 12 prompts, 1847 prompt tokens, 32 out each) through one ``LLM``, every int8 layer
switched between the two paths run by run (alternating), with the time spent in the int8 layers split into
prefill (more than 64 rows) and decode calls, and whether both paths generated the same tokens.
Nothing asserts a timing. Usage: ``python -m bench.int8_linear_ab [--offline] --out bench/results/int8_linear_ab.json``
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
from pipeline.quantization import int8 as int8_module
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


def run_offline(repeats: int, threads: int) -> dict:
    """Old and new int8 layers in one engine, alternating runs of the peer benchmark's 1.1B workload."""
    from collections import defaultdict

    from transformers import AutoTokenizer

    from bench.peer_checkpoints import peer_checkpoint
    from bench.peer_offline import LARGE_WORKLOADS, offline_workload
    from pipeline import LLM, SamplingParams

    torch.set_num_threads(threads)
    checkpoint = peer_checkpoint("1.1b", True)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    shape = LARGE_WORKLOADS["1.1b"]
    workload = offline_workload(argparse.Namespace(seed=0, **shape), len(tokenizer), set(tokenizer.all_special_ids))
    llm = LLM(model=str(checkpoint), model_config={"dtype": "bfloat16", "device": "cpu"}, max_batch_size=64,
              max_batch_input_tokens=2048, max_length=2048, kv_cache={"cpu_kv_cache_gib": 2})
    prompts, max_tokens = workload["prompt_token_ids"], workload["max_tokens"]
    native_call, state, in_layers = int8_module.Int8Matrix.__call__, {"path": "new"}, defaultdict(float)

    def timed_call(matrix, x, out_dtype):
        start = time.perf_counter()
        if state["path"] == "old":
            out = int8_product(x, matrix.weight_t, matrix.scale_row, matrix.act_scale)
            out = (out if matrix.bias is None else out.add_(matrix.bias)).to(out_dtype)
        else:
            out = native_call(matrix, x, out_dtype)
        in_layers[(state["path"], "prefill" if x.shape[0] > 64 else "decode")] += time.perf_counter() - start
        return out

    def generate(num: int | None = None) -> tuple[float, list]:
        llm.engine.kv_manager.reset_prefix_cache()
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens[:num]]
        start = time.perf_counter()
        outputs = llm.generate(prompts[:num], params)
        return time.perf_counter() - start, [o.token_ids for o in outputs]

    int8_module.Int8Matrix.__call__ = timed_call
    try:
        generate(4)
        runs, tokens = {"old": [], "new": []}, {}
        for _ in range(repeats):
            for path in ("new", "old"):
                state["path"] = path
                in_layers.clear()
                seconds, tokens[path] = generate()
                runs[path].append({"wall_s": round(seconds, 3), "tok_s": round(sum(max_tokens) / seconds, 1),
                                   "int8_prefill_s": round(in_layers[(path, "prefill")], 3),
                                   "int8_decode_s": round(in_layers[(path, "decode")], 3),
                                   "load_average_1m": os.getloadavg()[0]})
                print(f"offline {path}: {runs[path][-1]}", flush=True)
    finally:
        int8_module.Int8Matrix.__call__ = native_call
    median = {path: statistics.median(r["wall_s"] for r in runs[path]) for path in runs}
    return {"threads": threads, "workload": shape, "runs": runs, "median_wall_s": median,
            "speedup": round(median["old"] / median["new"], 2), "tokens_identical": tokens["old"] == tokens["new"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--threads", default=",".join(map(str, THREADS)))
    parser.add_argument("--offline", action="store_true", help="also the whole 1.1B model (threads: the largest)")
    parser.add_argument("--offline-repeats", type=int, default=3)
    parser.add_argument("--skip-layers", action="store_true", help="only --offline")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    # the torch code reads the [in, out] int8 layout, which the layers drop where the packed GEMM takes every
    # batch (no AMX): keep it, as an AMX CPU does (the packed path is unchanged, only the memory held grows)
    cpu_int8.packed_gemm_takes_every_batch = lambda: False
    rows = tuple(int(r) for r in args.rows.split(","))
    threads = tuple(int(t) for t in args.threads.split(","))
    report = {"cpu": cpu_description(), "native": cpu_native.describe(),
              "int8_gemm": cpu_native.ops.int8_gemm_isa() if cpu_native.ops is not None else None,
              "packed_gemm_for_all_rows": cpu_int8.packed_gemm_preferred(max(rows)),
              "repeats": args.repeats, "results": [] if args.skip_layers else run(args.repeats, rows, threads)}
    if args.offline:
        report["offline"] = run_offline(args.offline_repeats, max(threads))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
