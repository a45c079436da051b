"""Per-kernel GPU benchmark: each triton kernel against its torch reference, in time and bandwidth.

    python -m bench.kernel_bench --out kernel_bench.json [--peak-gbps 4800] [--dtype bf16] [--only attention]

Every case is timed with ``triton.testing.do_bench`` (median), checked against the reference, and
reported as bytes moved / time next to the HBM peak: 4800 GB/s for an H200 (the default), 3350 GB/s for
an H100 SXM. The bytes are the minimum traffic of the operation (each input read once, each output
written once), so ``pct_peak`` is the share of the roofline a memory-bound kernel reaches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Callable

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Case:
    kernel: str
    name: str
    run_triton: Callable[[], object]
    run_torch: Callable[[], object]
    num_bytes: int
    flops: int = 0
    written: Callable[[], tuple] | None = None  # in-place kernels: (triton's target, torch's target)


@dataclass
class Result:
    kernel: str
    case: str
    num_bytes: int
    triton_ms: float
    torch_ms: float
    triton_gbps: float
    torch_gbps: float
    triton_pct_peak: float
    speedup: float
    max_abs_err: float
    triton_tflops: float | None = None


def _paged_batch(num_seqs, q_len, context_len, num_q_heads, num_kv_heads, head_dim, page_size, dtype, device="cuda"):
    blocks_per_seq = -(-context_len // page_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    kv_cache = torch.randn(1, 2, num_blocks, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    block_tables = torch.randperm(num_blocks - 1, device=device)[: num_seqs * blocks_per_seq]
    block_tables = block_tables.view(num_seqs, blocks_per_seq).int()
    query = torch.randn(num_seqs * q_len, num_q_heads, head_dim, dtype=dtype, device=device)
    cu_seqlens_q = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32, device=device)
    context_lens = torch.full((num_seqs,), context_len, dtype=torch.int32, device=device)
    return query, kv_cache[0, 0], kv_cache[0, 1], cu_seqlens_q, context_lens, block_tables


def attention_cases(tk, rk, dtype):
    esize = torch.finfo(dtype).bits // 8
    cases = []
    # (name, num_seqs, q_len, context_len, q_heads, kv_heads, head_dim, page_size)
    shapes = [
        ("decode b64 ctx2k gqa4 d128 p16", 64, 1, 2048, 32, 8, 128, 16),
        ("decode b64 ctx2k gqa4 d128 p1", 64, 1, 2048, 32, 8, 128, 1),
        ("decode b8 ctx8k gqa4 d128 p16 (split-KV)", 8, 1, 8192, 32, 8, 128, 16),
        ("decode b1 ctx32k gqa8 d128 p32 (split-KV)", 1, 1, 32768, 64, 8, 128, 32),
        ("decode b64 ctx2k mha d64 p16", 64, 1, 2048, 16, 16, 64, 16),
        ("prefill 4x1k over 1k prefix gqa4 d128 p16", 4, 1024, 2048, 32, 8, 128, 16),
    ]
    for name, num_seqs, q_len, ctx, hq, hkv, d, page in shapes:
        batch = _paged_batch(num_seqs, q_len, ctx, hq, hkv, d, page, dtype)
        scale = d ** -0.5
        kv_bytes = 2 * num_seqs * ctx * hkv * d * esize
        qo_bytes = 2 * num_seqs * q_len * hq * d * esize
        visible = num_seqs * (q_len * ctx - q_len * (q_len - 1) // 2)  # causal (query, key) pairs
        cases.append(Case("paged_attention", name,
                          lambda b=batch, s=scale: tk.paged_attention(*b, s),
                          lambda b=batch, s=scale: rk.paged_attention(*b, s),
                          kv_bytes + qo_bytes, flops=4 * visible * hq * d))
    return cases


def other_cases(tk, rk, dtype):
    esize = torch.finfo(dtype).bits // 8
    cases = []
    for num_tokens in (64, 8192):
        hkv, d, page = 8, 128, 16
        caches = [torch.zeros(1, 2, num_tokens // page + 8, page, hkv, d, dtype=dtype, device="cuda")
                  for _ in range(2)]
        key, value = (torch.randn(num_tokens, hkv, d, dtype=dtype, device="cuda") for _ in range(2))
        slots = torch.randperm(caches[0].shape[2] * page, device="cuda")[:num_tokens]
        args = [(key, value, c[0, 0], c[0, 1], slots) for c in caches]
        cases.append(Case("store_kv", f"{num_tokens} tokens kvh8 d128 p16", lambda a=args[0]: tk.store_kv(*a),
                          lambda a=args[1]: rk.store_kv(*a), 4 * num_tokens * hkv * d * esize + 8 * num_tokens,
                          written=lambda c=caches: tuple(c)))
    for num_tokens, hidden in ((64, 4096), (8192, 4096), (8192, 8192)):
        x, residual = (torch.randn(num_tokens, hidden, dtype=dtype, device="cuda") for _ in range(2))
        weight = torch.randn(hidden, dtype=dtype, device="cuda")
        cases.append(Case("rms_norm", f"{num_tokens}x{hidden} +residual",
                          lambda a=(x, weight, 1e-6, residual): tk.rms_norm(*a),
                          lambda a=(x, weight, 1e-6, residual): rk.rms_norm(*a),
                          (4 * num_tokens + 1) * hidden * esize))
    for num_tokens in (64, 8192):
        hq, hkv, d = 32, 8, 128
        qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, dtype=dtype, device="cuda")
        query = qkv[:, : hq * d].view(num_tokens, hq, d)
        key = qkv[:, hq * d : (hq + hkv) * d].view(num_tokens, hkv, d)
        cos_sin = torch.randn(32768, d, device="cuda")
        positions = torch.randint(0, 32768, (num_tokens,), device="cuda")
        args = (query, key, positions, cos_sin)
        cases.append(Case("apply_rotary", f"{num_tokens} tokens q32 kv8 d128", lambda a=args: tk.apply_rotary(*a),
                          lambda a=args: rk.apply_rotary(*a),
                          2 * num_tokens * (hq + hkv) * d * esize + num_tokens * d * 4))
    num_layers, page, hkv, d, n = 32, 16, 8, 128, 128
    kv_cache = torch.randn(num_layers, 2, 1024, page, hkv, d, dtype=dtype, device="cuda")
    block_ids = torch.randperm(1024, device="cuda")[:n]
    run_bytes = 2 * 2 * n * page * hkv * d * esize  # per layer, read + write
    targets = (torch.zeros_like(kv_cache), torch.zeros_like(kv_cache))  # receiving caches: triton's, torch's
    for layers, label in ((slice(None), "all 32 layers"), (slice(5, 6), "one layer")):
        num_layers_sel = len(range(*layers.indices(num_layers)))
        cases.append(Case("pack_kv_blocks", f"{n} blocks p16 kvh8 d128, {label}",
                          lambda l=layers: tk.pack_kv_blocks(kv_cache, block_ids, l),
                          lambda l=layers: rk.pack_kv_blocks(kv_cache, block_ids, l), run_bytes * num_layers_sel))
        buffer = rk.pack_kv_blocks(kv_cache, block_ids, layers)
        cases.append(Case("unpack_kv_blocks", f"{n} blocks p16 kvh8 d128, {label}",
                          lambda b=buffer, l=layers: tk.unpack_kv_blocks(b, targets[0], block_ids, l),
                          lambda b=buffer, l=layers: rk.unpack_kv_blocks(b, targets[1], block_ids, l),
                          run_bytes * num_layers_sel, written=lambda t=targets: t))
    return cases


def _max_abs_err(case: Case) -> float:
    a, b = case.run_triton(), case.run_torch()
    if case.written is not None:  # in-place kernels write to separate targets
        a, b = case.written()
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


def run_case(case: Case, peak_gbps: float) -> Result:
    from triton.testing import do_bench

    err = _max_abs_err(case)
    triton_ms = do_bench(case.run_triton, return_mode="median")
    torch_ms = do_bench(case.run_torch, return_mode="median")
    triton_gbps, torch_gbps = case.num_bytes / triton_ms / 1e6, case.num_bytes / torch_ms / 1e6
    return Result(
        kernel=case.kernel, case=case.name, num_bytes=case.num_bytes,
        triton_ms=round(triton_ms, 5), torch_ms=round(torch_ms, 5),
        triton_gbps=round(triton_gbps, 1), torch_gbps=round(torch_gbps, 1),
        triton_pct_peak=round(100 * triton_gbps / peak_gbps, 1), speedup=round(torch_ms / triton_ms, 2),
        max_abs_err=err, triton_tflops=round(case.flops / triton_ms / 1e9, 1) if case.flops else None,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="kernel_bench.json", help="where to write the JSON results")
    parser.add_argument("--peak-gbps", type=float, default=4800.0,
                        help="HBM peak in GB/s for pct_peak: 4800 for H200 (default), 3350 for H100 SXM")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--only", default=None, help="run only kernels whose name contains this")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    if not torch.cuda.is_available():
        print("kernel_bench: no CUDA device is visible; this benchmark times GPU kernels and needs one "
              "(the CPU path is the torch reference, tested rather than benchmarked)", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        print("kernel_bench: TRITON_INTERPRET is set; unset it to time compiled kernels", file=sys.stderr)
        return 2

    from kernels import TORCH_KERNELS, load_kernels

    triton_kernels = load_kernels("triton", "cuda")
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    results = []
    for make in (attention_cases, other_cases):
        for case in make(triton_kernels, TORCH_KERNELS, dtype):
            if args.only and args.only not in case.kernel:
                continue
            result = run_case(case, args.peak_gbps)
            results.append(result)
            print(f"{result.kernel:17s} {result.case:44s} triton {result.triton_ms:9.4f} ms "
                  f"{result.triton_gbps:8.1f} GB/s ({result.triton_pct_peak:5.1f}%)  torch {result.torch_ms:9.4f} ms  "
                  f"x{result.speedup:<6} err {result.max_abs_err:.2e}", flush=True)
    report = {
        "device": torch.cuda.get_device_name(),
        "dtype": args.dtype,
        "peak_gbps": args.peak_gbps,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "results": [asdict(r) for r in results],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {len(results)} results to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
