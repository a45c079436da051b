"""int8 W8A8 against bf16 and fp32 on the CPU: one linear layer's GEMM, and the offline engine end to end.

- ``gemm``: a 1.1B-shape layer (TinyLlama: hidden 2048, the fused gate/up 2048 -> 11264, down 5632 -> 2048)
  at several row counts: fp32 and bf16 through ``CpuLinear`` (oneDNN, weights packed once: the CPU set's
  path), ``Int8Linear`` (per-token activation quantization, the int8 GEMM and the rescale: the native VNNI
  path on a CPU with AVX-512 VNNI, ``torch._int_mm`` between native passes elsewhere), and the bare
  ``torch._int_mm`` alone. The fastest of interleaved repeats, GFLOP/s counted as 2 * rows * in * out.
- ``offline``: the ~150M random llama of ``bench.offline_throughput`` ("large") through ``LLM.generate``:
  prefill (16 prompts of 128 tokens, one output token each) and decode (16 prompts of 16 tokens, 32 greedy
  tokens each) in fp32, bf16, and each with ``--quantization int8``, default engine settings (prefill chunks
  of 512 tokens), the four engines loaded at once and taking turns.

The CPU (model name and its AVX-512 VNNI / BF16 / AMX flags) is recorded with the numbers; nothing asserts a
timing. Usage: ``python -m bench.quantization_bench --out bench/results/quantization.json``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from kernels.cpu_gemm import CpuLinear
from pipeline.quantization.int8 import Int8Linear, quantize_per_row

SHAPES = {"qkv 2048->2560": (2048, 2560), "gate_up 2048->11264": (2048, 11264), "down 5632->2048": (5632, 2048)}
ROWS = (1, 8, 32, 128, 512)
CPU_FLAGS = ("avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16", "avx_vnni")


def cpu_description() -> dict:
    info = {"machine": platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "load_average_1m": os.getloadavg()[0]}
    try:
        text = Path("/proc/cpuinfo").read_text()
        info["model"] = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
        flags = set(next(line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")))
        info["flags"] = {flag: flag in flags for flag in CPU_FLAGS}
    except (OSError, StopIteration):
        pass
    return info


def interleaved_seconds(fns: dict, repeats: int) -> dict[str, float]:
    """The fastest of ``repeats`` timed calls of each function, the functions taking turns within each round:
    on a machine other work shares, the minimum is the least disturbed measure and turns spread any burst of
    contention over every variant alike."""
    for fn in fns.values():
        fn()  # warm-up: oneDNN picks and caches its kernel on the first call
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def bench_gemm(repeats: int) -> list[dict]:
    rows_out = []
    generator = torch.Generator().manual_seed(0)
    for shape_name, (in_features, out_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features, generator=generator) * 0.02  # [out, in]
        fp32 = CpuLinear(weight, None)
        bf16 = CpuLinear(weight.to(torch.bfloat16), None)
        int8 = Int8Linear(in_features, [out_features], False, torch.float32, "cpu", is_prequantized=False)
        int8.weight.data.copy_(weight)
        int8.finish_loading()
        for rows in ROWS:
            x = torch.randn(rows, in_features, generator=generator)
            x_bf16, (x_q, _) = x.to(torch.bfloat16), quantize_per_row(x)
            flops = 2 * rows * in_features * out_features
            entry = {"shape": shape_name, "rows": rows}
            timings = interleaved_seconds({
                "fp32": lambda: fp32(x), "bf16": lambda: bf16(x_bf16), "int8_w8a8": lambda: int8(x),
                "int_mm_only": lambda: torch._int_mm(x_q, int8.weight_t)}, repeats)
            for name, seconds in timings.items():
                entry[f"{name}_ms"] = round(seconds * 1e3, 4)
                entry[f"{name}_gflops"] = round(flops / seconds / 1e9, 1)
            rows_out.append(entry)
            print(json.dumps(entry), flush=True)
    return rows_out


def bench_offline(repeats: int) -> list[dict]:
    from bench.offline_throughput import MODEL_SIZES
    from pipeline import LLM, SamplingParams
    from pipeline.builtin_model import build_checkpoint

    results = []
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        path = build_checkpoint(Path(directory) / "large", "llama", **MODEL_SIZES["large"])
        vocab_size = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
        long_prompts = [torch.randint(3, vocab_size, (128,), generator=generator).tolist() for _ in range(16)]
        short_prompts = [torch.randint(3, vocab_size, (16,), generator=generator).tolist() for _ in range(16)]
        engines = {(dtype, quantization): LLM(
            str(path), model_config={"dtype": dtype, "quantization": quantization},
            kv_cache={"num_blocks": 1024, "page_size": 16, "enable_prefix_caching": False})
            for dtype in ("float32", "bfloat16") for quantization in (None, "int8")}
        prefill_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        decode_params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        calls = {}
        for key, llm in engines.items():  # every engine takes its turn in each round (see interleaved_seconds)
            calls[key + ("prefill",)] = lambda llm=llm: llm.generate(long_prompts, prefill_params)
            calls[key + ("decode",)] = lambda llm=llm: llm.generate(short_prompts, decode_params)
        timings = interleaved_seconds(calls, repeats)
        for dtype, quantization in engines:
            entry = {"dtype": dtype, "quantization": quantization or "none",
                     "prefill_tokens_per_s": round(16 * 128 / timings[dtype, quantization, "prefill"], 1),
                     "decode_output_tokens_per_s": round(16 * 32 / timings[dtype, quantization, "decode"], 1)}
            results.append(entry)
            print(json.dumps(entry), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--only", choices=("gemm", "offline"), default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {"cpu": cpu_description()}
    print(json.dumps(report["cpu"]), flush=True)
    if args.only in (None, "gemm"):
        report["gemm"] = bench_gemm(args.repeats)
    if args.only in (None, "offline"):
        report["offline"] = bench_offline(max(1, args.repeats // 3))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
