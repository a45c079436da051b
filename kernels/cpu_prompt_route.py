"""Where a bf16 prompt chunk's attention runs on an AMX CPU, measured on the machine at load.

``kernels/cpu_paged_attention.py`` sends a bf16 sequence of ``FLASH_MIN_QUERY_ROWS`` or more query rows to
torch's flash attention (library bf16 GEMMs, on AMX tiles where the CPU has them) and the rest to the native
kernel (AVX-512 FMAs in fp32, reading K/V in place). Which is faster, and from how many rows, depends on the
CPU, the thread count and the model's heads; a fixed rule could only guess. So on a CPU whose flags list
``amx_bf16`` (the only CPUs that route at all), ``calibrate_for_model`` times both paths when a bf16 model is
prepared, on causal chunks of ``CANDIDATE_ROWS`` rows with the model's own heads, alternating, and routes from
the smallest row count from which torch's path won every chunk measured (none: nothing is routed). It takes a
fraction of a second, once per process, and is logged. ``TANDEM_CPU_FLASH_MIN_QUERY_ROWS`` (a row count, or
``off``) replaces the measurement; ``python -m bench.cpu_prompt_attention`` reports the full picture.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Callable

import torch

from kernels import cpu_native, cpu_paged_attention

logger = logging.getLogger(__name__)

# The route only pays where the products are big enough for the GEMMs; a larger chunk costs about what 256 rows do
# per query-key pair, and is routed with them.
CANDIDATE_ROWS = (64, 128, 256)
CALIBRATION_PREFIXES = (0, 256)  # a prompt's first chunk, and a later one over cached keys
CALIBRATION_REPEATS = 3
PAGE_SIZE = 16


def chunk_inputs(rows: int, prefix: int, dtype: torch.dtype, generator: torch.Generator, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, page_size: int = PAGE_SIZE):
    """``paged_attention_cpu``'s arguments for one sequence's ``rows`` queries at the end of ``prefix + rows`` keys,
    in shuffled pages."""
    keys = prefix + rows
    num_pages = -(-keys // page_size)
    shape = (num_pages + 4, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    block_table = torch.randperm(num_pages + 4, generator=generator)[:num_pages].to(torch.int32)[None]
    query = torch.randn(rows, num_q_heads, head_dim, generator=generator).to(dtype)
    cu_seqlens_q = torch.tensor([0, rows], dtype=torch.int32)
    context_lens = torch.tensor([keys], dtype=torch.int32)
    return query, k_cache, v_cache, cu_seqlens_q, context_lens, block_table, head_dim ** -0.5


def visible_pairs(rows: int, prefix: int, num_q_heads: int) -> int:
    """Query-key pairs a causal chunk computes, over every query head."""
    return num_q_heads * (rows * prefix + rows * (rows + 1) // 2)


def time_both(inputs, repeats: int) -> tuple[list[float], list[float], float]:
    """Seconds per call of the native path and of torch's, alternating, and their largest output difference; the
    route in force is restored afterwards."""
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


def measure(num_q_heads: int, num_kv_heads: int, head_dim: int, rows=CANDIDATE_ROWS, prefixes=CALIBRATION_PREFIXES,
            repeats: int = CALIBRATION_REPEATS) -> list[dict]:
    """Both paths' best time per query-key pair on bf16 chunks of the given heads (the best of ``repeats``: a
    calibration wants each path's speed, not the neighbours' noise), from the most rows down, stopping after the
    first row count where the native kernel won a chunk: fewer rows cannot move the crossover (and on a CPU where
    the native kernel wins, only the largest chunks are timed)."""
    generator = torch.Generator().manual_seed(0)
    cases = []
    for num_rows in sorted(rows, reverse=True):
        for prefix in prefixes:
            inputs = chunk_inputs(num_rows, prefix, torch.bfloat16, generator, num_q_heads, num_kv_heads, head_dim)
            native_s, torch_s, _ = time_both(inputs, repeats)
            pairs = visible_pairs(num_rows, prefix, num_q_heads)
            cases.append({"rows": num_rows, "prefix": prefix, "native_ns_per_pair": min(native_s) / pairs * 1e9,
                          "torch_ns_per_pair": min(torch_s) / pairs * 1e9})
        if any(c["native_ns_per_pair"] <= c["torch_ns_per_pair"] for c in cases if c["rows"] == num_rows):
            break
    return cases


def attention_geometry(model: torch.nn.Module) -> tuple[int, int, int, torch.dtype] | None:
    """(query heads, KV heads, head dim, dtype) of the model's first attention layer that keeps K/V per head;
    None where it has none (latent attention keeps one latent row: its chunks are not routed by this rule)."""
    for module in model.modules():
        heads = [getattr(module, name, None) for name in ("num_q_heads", "num_kv_heads", "head_dim")]
        projection = getattr(module, "qkv_proj", None)
        if all(isinstance(h, int) for h in heads) and projection is not None:
            # the activations' dtype: a quantized projection's own (its weight is int8 or fp8), else its weight's
            dtype = getattr(projection, "dtype", None) or next(
                (p.dtype for p in projection.parameters() if p.dtype in (torch.float32, torch.bfloat16, torch.float16)),
                None)
            return (*heads, dtype) if isinstance(dtype, torch.dtype) else None
    return None


def should_calibrate(dtype: torch.dtype) -> bool:
    """A bf16 model on a CPU with AMX, the native kernels built, and no row count set by hand."""
    return (dtype == torch.bfloat16 and cpu_native.ops is not None and "amx_bf16" in cpu_native.cpu_flags()
            and os.environ.get("TANDEM_CPU_FLASH_MIN_QUERY_ROWS") is None)


def calibrate_for_model(model: torch.nn.Module,
                        measure_cases: Callable[[int, int, int], list[dict]] | None = None) -> int | None:
    """Measure (``measure_cases``, default ``measure``) and set ``FLASH_MIN_QUERY_ROWS`` for ``model``'s heads where
    ``should_calibrate``; returns the row count in force afterwards. Once per process: a second model (a draft's)
    keeps what the first measured."""
    geometry = attention_geometry(model)
    if (geometry is None or not should_calibrate(geometry[3])
            or cpu_paged_attention.FLASH_ROUTE_SOURCE == "calibrated"):
        return cpu_paged_attention.FLASH_MIN_QUERY_ROWS
    num_q_heads, num_kv_heads, head_dim, _ = geometry
    started = time.perf_counter()
    cases = (measure_cases or measure)(num_q_heads, num_kv_heads, head_dim)
    rows = crossover(cases)
    cpu_paged_attention.set_flash_route(rows, source="calibrated")
    largest = max(cases, key=lambda case: (case["rows"], case["prefix"]))
    logger.info("bf16 prompt attention on this AMX CPU: %s (measured in %.2f s on %d query / %d KV heads of %d, %d "
                "threads; %d rows over %d keys: native %.2f, torch %.2f ns per pair; median over all chunks: native "
                "%.2f, torch %.2f)", cpu_paged_attention.describe_prompt_route(), time.perf_counter() - started,
                num_q_heads, num_kv_heads, head_dim, torch.get_num_threads(), largest["rows"], largest["prefix"],
                largest["native_ns_per_pair"], largest["torch_ns_per_pair"],
                statistics.median(c["native_ns_per_pair"] for c in cases),
                statistics.median(c["torch_ns_per_pair"] for c in cases))
    return rows
