"""Linear layers on the CPU: weights packed once for oneDNN, and bf16 models on CPUs without bf16 GEMMs.

``F.linear`` on the CPU hands the weight to MKL in its checkpoint layout on every call, which small
batches pay for: measured on this project's 2-core machine, oneDNN with the weight packed once is 1.2-1.7x
faster for 2-64 rows on one thread and 1.6-4.4x on two (decode batches), the same from about 128
rows, and slower for a single fp32 row on one thread (AVX2, Zen 3; docs/benchmarks.md). On an AVX-512 CPU the packed
weight wins at every row count (MKL runs its AVX2 code on a non-Intel CPU). So ``CpuLinear`` keeps both forms and
picks by the CPU, the number of rows and the dtype. Where the packed copy serves every call (an AVX-512 CPU),
the checkpoint-layout copy is dropped once packed (``needs_plain_weight``), so the weights are held once;
elsewhere both are kept (twice the weights' memory), and ``model.cpu_weight_prepack`` turns the packed copy off.
On a CPU with AVX512-BF16 and no AMX, bf16 layers take the native panel GEMM instead of oneDNN
(``bf16_panels_preferred``: decode steps up to 1.6x faster), its copy the only one. On an AMX CPU they may hold both
copies, batches of up to a row count measured at load taking the panels (``kernels/cpu_bf16_route.py``).

bf16 weights on a CPU whose oneDNN has no bf16 GEMM (no AVX-512 BW/VL/DQ nor AVX-NE-CONVERT, e.g. AMD Zen
3) would run torch's reference bf16 matmul at a few GFLOP/s. There the weights are widened to fp32 once
(every bf16 value is exact in fp32), the bf16 activations are widened per call, the product is
accumulated in fp32 and rounded to bf16: what a bf16 GEMM with fp32 accumulation computes, at fp32 speed.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels import cpu_moe, cpu_native

# Row counts for which the packed weight is used (others: F.linear). On a CPU with AVX-512 it takes every row count:
# F.linear's BLAS is MKL, which runs its AVX2 code on a non-Intel CPU, and oneDNN's AVX-512 kernels beat it at every
# size measured on Zen 5 (fp32: 2.2-2.4x at 257-2048 rows on 1 and 2 threads, ~100 against ~225 GFLOP/s a core, and
# 1.3-1.5x for one row; bf16: 1.02-1.06x from 300 rows, 2-2.7x for one row; docs/cpu-kernels.md). Without AVX-512
# (measured on Zen 3, AVX2): packed for 2-256 rows, where it is 1.2-4.4x faster, F.linear past them (0.82-1.02x
# packed) and for one fp32 row on one thread (MKL's GEMV); a bf16 row there is computed in fp32 anyway.
_IS_AVX512 = "avx512f" in cpu_native.cpu_flags()
PACKED_MIN_ROWS = 1 if _IS_AVX512 else 2
PACKED_MAX_ROWS: int | None = None if _IS_AVX512 else 256  # None: no limit


BF16_GEMM_ENV = "TANDEM_CPU_BF16_GEMM"

# On an AMX CPU, bf16 batches of up to this many rows take the native panel GEMM where a layer holds its copy
# beside oneDNN's (``bf16_panels_beside_onednn``; 0: none do, None: every batch). oneDNN runs AMX tiles, which
# prefill wants; a decode batch reads each weight once for a few rows, which the panel GEMM streams faster on the
# CPUs measured (Zen 4: 1.15-1.5x for 1-8 rows, docs/cpu-kernels.md). 0 until a model is measured at load
# (kernels/cpu_bf16_route.py), which sets it and lets go of the copy its route never reads.
AMX_PANELS_MAX_ROWS: int | None = 0
AMX_PANELS_SOURCE = "default"


def set_amx_panels_max_rows(rows: int | None, source: str = "calibrated") -> None:
    """On an AMX CPU, bf16 batches of up to ``rows`` rows take the panel GEMM where a layer holds both copies."""
    global AMX_PANELS_MAX_ROWS, AMX_PANELS_SOURCE
    AMX_PANELS_MAX_ROWS, AMX_PANELS_SOURCE = rows, source


def _bf16_gemm_setting() -> str:
    raw = os.environ.get(BF16_GEMM_ENV, "auto").strip().lower()
    if raw not in ("auto", "onednn", "panels"):
        raise ValueError(f"{BF16_GEMM_ENV}={raw!r}: use auto, onednn or panels")
    if raw == "panels" and not cpu_moe.native_available():
        raise ValueError(f"{BF16_GEMM_ENV}=panels: this CPU has no AVX512-BF16 for the native panel GEMM")
    return raw


def bf16_panels_beside_onednn() -> bool:
    """Whether bf16 linears may keep the panel copy beside oneDNN's for decode batches: ``auto`` on a CPU
    with AMX and AVX512-BF16 (memory permitting: ``kernels/cpu_backend.py`` asks ``cpu_bf16_route``)."""
    flags = cpu_native.cpu_flags()
    if "amx_bf16" not in flags or "avx512_bf16" not in flags:
        return False  # the setting is read (and checked) only where it can matter: no other CPU's models change
    return _bf16_gemm_setting() == "auto" and cpu_moe.native_available()


def bf16_panels_preferred() -> bool:
    """Whether bf16 linears run the native panel GEMM (``kernels/native/moe_gemm.h`` with one expert: the
    weight packed once, instead of oneDNN's copy, in 32-column panels of K pairs for AVX512-BF16's ``vdpbf16ps``)
    rather than oneDNN. ``auto`` (the default) chooses it on a CPU with AVX512-BF16 and no AMX. Measured on Zen 4, 2
    threads, the 1.1B shape: decode steps 1.6x faster at batch 1 (74-81 against 124-127 ms a step; it streams the
    weights at 27-28 GB/s where oneDNN reads 17-21) and 1.1-1.2x at batch 12, within +-5 % of oneDNN's GFLOP/s for
    64-1847 rows, and the prefill-heavy offline workload the same (medians of 12 runs, 12.85 against 13.0 s). On an
    AMX CPU oneDNN runs AMX tiles, which this kernel does not (there it may take decode batches beside oneDNN:
    ``bf16_panels_beside_onednn``). ``TANDEM_CPU_BF16_GEMM`` (``auto`` / ``onednn`` / ``panels``) sets it instead."""
    raw = _bf16_gemm_setting()
    if raw == "auto":
        flags = cpu_native.cpu_flags()
        return cpu_moe.native_available() and "avx512_bf16" in flags and "amx_bf16" not in flags
    return raw == "panels"


def describe_bf16_route() -> str | None:
    """For the kernel set's name: where bf16 linears do not run oneDNN (None where they do)."""
    if bf16_panels_preferred():
        return "bf16 linears native panels"
    if not bf16_panels_beside_onednn():
        return None
    route = ("bf16 linears on oneDNN (AMX)" if AMX_PANELS_MAX_ROWS == 0
             else "bf16 linears native panels" if AMX_PANELS_MAX_ROWS is None
             else f"bf16 batches up to {AMX_PANELS_MAX_ROWS} rows on native panels, the rest on oneDNN (AMX)")
    return f"{route} ({AMX_PANELS_SOURCE})"


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def bf16_gemm_native() -> bool:
    """Whether this CPU's oneDNN runs bf16 GEMMs itself (else CpuLinear computes bf16 layers in fp32)."""
    if not onednn_available():
        return False
    try:
        probe = torch.zeros(8, 8, dtype=torch.bfloat16)
        torch.ops.mkldnn._reorder_linear_weight(probe, 8)
        return True
    except RuntimeError:  # "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"
        return False


class CpuLinear:
    """``y = x W^T (+ b)`` for one weight on the CPU, in the weight's dtype, with the fastest GEMM per call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool = True,
                 widen_bf16: bool | None = None, panels_beside_onednn: bool = False):
        self.dtype = weight.dtype
        if widen_bf16 is None:
            widen_bf16 = self.dtype == torch.bfloat16 and not bf16_gemm_native()
        self.compute_dtype = torch.float32 if widen_bf16 else self.dtype
        self.out_features = weight.shape[0]
        self.weight: torch.Tensor | None = weight if not widen_bf16 else weight.float()  # [out, in]
        self.bias = bias if bias is None or not widen_bf16 else bias.float()
        self.packed = None
        self.panels: cpu_moe.PackedExperts | None = None  # the native panel GEMM's copy (bf16_panels_preferred)
        self.panel_bias: torch.Tensor | None = None  # its fp32 bias, padded to whole panels
        if prepack and self.compute_dtype == torch.bfloat16 and bf16_panels_preferred():
            self.panels = cpu_moe.pack(weight.unsqueeze(0))
        elif prepack and onednn_available() and self.compute_dtype in (torch.float32, torch.bfloat16):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 64)
            if panels_beside_onednn and self.compute_dtype == torch.bfloat16:
                self.panels = cpu_moe.pack(weight.unsqueeze(0))  # decode batches, on an AMX CPU (see above)
        if self.panels is not None and bias is not None:
            self.panel_bias = cpu_moe.padded_bias(bias, self.panels)
        if not self.needs_plain_weight:
            self.weight = None  # every call reads the packed copy: the checkpoint layout would only take memory

    @property
    def needs_plain_weight(self) -> bool:
        """Whether some call takes ``F.linear`` over the checkpoint-layout weight rather than the packed copy."""
        return self.panels is None and (self.packed is None or PACKED_MIN_ROWS > 1 or PACKED_MAX_ROWS is not None)

    def holds(self, weight: torch.Tensor) -> bool:
        """Whether this GEMM still reads ``weight``'s memory (else the layer's own parameter can be let go)."""
        return (self.weight is not None
                and self.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        lead, rows = x.shape[:-1], x.numel() // x.shape[-1]
        if rows == 0:
            return x.new_empty((*lead, self.out_features), dtype=self.dtype)
        if self.takes_panels(rows):
            return self.panel_product(x.reshape(rows, x.shape[-1])).view(*lead, self.out_features)
        use_packed = self.packed is not None and (
            (PACKED_MIN_ROWS <= rows and (PACKED_MAX_ROWS is None or rows <= PACKED_MAX_ROWS))
            or (rows == 1 and (torch.get_num_threads() > 1 or self.compute_dtype == torch.bfloat16)))
        if use_packed:
            out = self.onednn_product(x.reshape(rows, x.shape[-1])).view(*lead, self.out_features)
        else:
            out = F.linear(x, self.weight, self.bias)
        return out if out.dtype == self.dtype else out.to(self.dtype)

    def takes_panels(self, rows: int) -> bool:
        """Whether a bf16 batch of ``rows`` rows runs the native panel GEMM (else oneDNN or ``F.linear``)."""
        return self.panels is not None and (self.packed is None or AMX_PANELS_MAX_ROWS is None
                                            or rows <= AMX_PANELS_MAX_ROWS)

    def panel_product(self, flat: torch.Tensor) -> torch.Tensor:  # [rows, in] bf16 -> [rows, out]
        """The native panel GEMM over the panel copy: one group of every row."""
        return cpu_moe.grouped_gemm(flat, cpu_moe.one_group(flat.shape[0]), self.panels, self.panel_bias)

    def onednn_product(self, flat: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        """oneDNN over its packed copy (AMX tiles on a CPU that has them)."""
        return torch.ops.mkldnn._linear_pointwise(flat.contiguous(), self.packed, self.bias, "none", [], "")

    def release_unread_copy(self) -> int:
        """A layer holding both the panel and oneDNN copies (an AMX CPU's) lets go of the one that
        ``AMX_PANELS_MAX_ROWS`` routes no batch to; returns the bytes let go."""
        if self.panels is None or self.packed is None:
            return 0
        if AMX_PANELS_MAX_ROWS == 0:
            released, self.panels, self.panel_bias = self.panels.packed, None, None
        elif AMX_PANELS_MAX_ROWS is None:
            released, self.packed = self.packed, None
        else:
            return 0
        return released.numel() * released.element_size()
