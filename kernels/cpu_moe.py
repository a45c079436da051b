"""A mixture-of-experts layer's bf16 expert GEMMs on the CPU in one native call per GEMM
(``kernels/native/moe_gemm.h``), and its combine (rows back into tokens) in one native pass, fp32 and bf16.

``StackedExperts`` (pipeline/models/moe.py) calls ``GroupedExperts`` over its rows grouped by expert: all experts'
gate/up GEMM in one call, the SiLU-and-mul over all rows, all experts' down GEMM in one call, wherever no expert has
more than ``MAX_ROWS_PER_EXPERT`` rows (every step, on a CPU without AMX); larger groups keep a packed oneDNN GEMM pair
per expert (on AMX CPUs oneDNN runs AMX for prefill-sized groups). The weights are packed once at load (``pack``) in
the panels the kernel streams. bf16 only: fp32 models keep the oneDNN loop. gpt-oss's experts (``GptOssExperts``,
pipeline/models/gpt_oss.py) take the same path with each expert's bias and their clamped SwiGLU.

Why: one oneDNN call pair per expert read the experts' weights at 14-20 GB/s of the machine's 36-45 in decode
(per-call overhead, two threads splitting each tiny GEMM); one call per layer, its threads splitting
(expert, column panel) items, reads them near memory bandwidth (docs/benchmarks.md, issue 33).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_native
from kernels.moe_ref import combine_grouped_rows

PANEL = 32  # output columns per packed panel (moe_gemm.h)

# Most rows any expert may have for the one-call path (None: no limit). Without AMX it takes every group: on this
# project's Zen 5 (AVX512-BF16, no AMX) it beat the per-expert oneDNN loop at 1-512 rows per expert in isolation
# (bench/moe_gemm_ab.py: 2-3x at 1-8 rows, 1.03-1.3x at 128-512), and in a real prefill it wins by more, because the
# loop hands oneDNN a new row count per expert and step, and oneDNN builds a new GEMM primitive for each new shape
# (768x768 at 400-600 rows, 2 threads: 794 GFLOP/s at a fixed count, 525-580 at counts never seen before). Same
# process, the Qwen3-MoE peer workload, medians of 4 alternating runs: 8.15 -> 6.35 s on 2 threads, 14.1 -> 13.2 s
# on 1. Where the CPU has AMX, oneDNN's AMX kernels should take groups larger than a decode's (not measured: no AMX
# machine was at hand).
MAX_ROWS_PER_EXPERT: int | None = 16 if "amx_bf16" in cpu_native.cpu_flags() else None


@dataclass
class PackedExperts:
    """Every expert's ``[out, in]`` bf16 weight in the native GEMM's layout, padded to whole panels and pairs."""

    packed: torch.Tensor  # bf16 [num_experts, panels, k2, 32, 2]
    in_features: int
    out_features: int


def native_available() -> bool:
    """Whether the one-call expert GEMM runs here (an AVX512-BF16 CPU, or a test that chose the portable body)."""
    return cpu_native.ops is not None and cpu_native.ops.moe_gemm_isa() is not None


def pack(weights: torch.Tensor) -> PackedExperts:
    """bf16 ``[num_experts, out, in]`` (any strides) -> the packed form."""
    num_experts, out_features, in_features = weights.shape
    k2 = -(-in_features // 2)
    panels = -(-out_features // PANEL)
    padded = F.pad(weights, (0, 2 * k2 - in_features, 0, panels * PANEL - out_features))  # [E, panels*32, 2*k2]
    packed = padded.view(num_experts, panels, PANEL, k2, 2).permute(0, 1, 3, 2, 4).contiguous()
    return PackedExperts(packed, in_features, out_features)


@functools.lru_cache(maxsize=4096)
def equal_groups(num_groups: int, rows_each: int) -> torch.Tensor:
    """``grouped_gemm``'s offsets for ``num_groups`` experts taking ``rows_each`` rows in turn: ``[0, rows_each, ...,
    num_groups * rows_each]``, made once per shape (a fresh tensor costs ~3 us; a step of the 1.1B shape makes 89
    such calls)."""
    return torch.arange(num_groups + 1, dtype=torch.int64) * rows_each


def one_group(num_rows: int) -> torch.Tensor:
    """The offsets for one expert taking every row (a dense linear's call): ``[0, num_rows]``."""
    return equal_groups(1, num_rows)


def grouped_gemm(rows: torch.Tensor, offsets: torch.Tensor, weights: PackedExperts,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 ``[num_rows, in]`` grouped by expert (expert e's rows ``offsets[e]:offsets[e + 1]``, int64) ->
    ``[num_rows, out]``: each expert's rows times its weight, fp32 sums (plus ``bias``, fp32: ``[panels * 32]``, a
    dense linear's, or ``[num_experts, panels * 32]``, each expert's) rounded once to bf16."""
    out = torch.empty((rows.shape[0], weights.out_features), dtype=torch.bfloat16)
    if rows.shape[0] == 0:
        return out
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    cpu_native.ops.moe_gemm(rows.data_ptr(), weights.packed.data_ptr(), offsets.data_ptr(), out.data_ptr(),
                            weights.packed.shape[0], rows.stride(0), out.stride(0), weights.in_features,
                            weights.out_features, torch.get_num_threads(), 0 if bias is None else bias.data_ptr(),
                            bias.shape[-1] if bias is not None and bias.dim() == 2 else 0)
    return out


def padded_bias(bias: torch.Tensor, weights: PackedExperts) -> torch.Tensor:
    """A dense linear's bias ``[out]`` (or every expert's, ``[num_experts, out]``) as ``grouped_gemm`` adds it: fp32,
    padded with zeros to whole panels."""
    return F.pad(bias.float(), (0, weights.packed.shape[1] * PANEL - bias.shape[-1])).contiguous()


class GroupedExperts:
    """A layer's experts packed for the one-call path: ``(rows grouped by expert, rows per expert, activation)``
    -> the experts' outputs, or None where the groups are too large for it (the caller runs its per-expert loop).
    ``activation`` maps the gate/up rows to the down projection's input (SiLU-and-mul; gpt-oss's clamped SwiGLU);
    biased experts (gpt-oss's) add each expert's fp32 bias before the rounding."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor,  # [E, 2 * inter, hidden], [E, hidden, inter]
                 gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None):  # [E, 2 * inter]...
        self.gate_up = pack(gate_up)
        self.down = pack(down)
        self.gate_up_bias = None if gate_up_bias is None else padded_bias(gate_up_bias, self.gate_up)
        self.down_bias = None if down_bias is None else padded_bias(down_bias, self.down)

    def __call__(self, grouped: torch.Tensor, rows_per_expert: torch.Tensor, activation) -> torch.Tensor | None:
        if grouped.dtype != torch.bfloat16 or not native_available() or (
                MAX_ROWS_PER_EXPERT is not None and int(rows_per_expert.max()) > MAX_ROWS_PER_EXPERT):
            return None
        offsets = F.pad(torch.cumsum(rows_per_expert, 0), (1, 0))  # [num_experts + 1] int64
        projected = grouped_gemm(grouped, offsets, self.gate_up, self.gate_up_bias)
        return grouped_gemm(activation(projected), offsets, self.down, self.down_bias)


_COMBINE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def combine_grouped_rows_cpu(grouped_out: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor,
                             dtype: torch.dtype) -> torch.Tensor:
    """``kernels.moe_ref.combine_grouped_rows``' contract, natively: each token gathers its ``top_k`` rows from
    where they sit in expert order and sums them, weighted, in fp32 (bit for bit the reference's order and
    rounding); the reference's ``index_add_`` runs on one thread, this splits the tokens over the threads.
    Measured (hidden 768, top-8, bf16, 2048 tokens): 31 ms per layer for the reference on 1 thread, 20 on 2."""
    num_tokens, top_k = topk_weights.shape
    if not (cpu_native.ops is not None and grouped_out.dtype == dtype and dtype in _COMBINE_DTYPES
            and grouped_out.dim() == 2 and grouped_out.stride(-1) == 1 and 1 <= top_k <= 64
            and grouped_out.device.type == "cpu"):
        return combine_grouped_rows(grouped_out, order, topk_weights, dtype)
    positions = torch.empty_like(order)
    positions[order] = torch.arange(order.numel(), dtype=order.dtype)  # [num_tokens * top_k]: row -> its place
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [num_tokens * top_k]
    out = torch.empty((num_tokens, grouped_out.shape[1]), dtype=dtype)
    cpu_native.ops.moe_combine(grouped_out.data_ptr(), positions.data_ptr(), weights.data_ptr(), out.data_ptr(),
                               num_tokens, grouped_out.stride(0), out.stride(0), top_k, grouped_out.shape[1],
                               _COMBINE_DTYPES[dtype], torch.get_num_threads())
    return out
