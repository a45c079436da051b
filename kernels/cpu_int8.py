"""The W8A8 int8 linear's native CPU pieces (``kernels/native/int8_isa.h``, ``int8_gemm.h``) and their packing.

``Int8Linear`` and the int8 MoE experts (``pipeline/quantization``) call ``packed_product`` where the weight
was packed at load (``pack``: a CPU with AVX-512 VNNI), else ``unpacked_product`` (torch._int_mm between the
native quantize and rescale passes). Both give what the torch code in ``quantization/int8.py`` gives, bit for
bit: the int32 products are exact and every float step is the same fp32 operation in the same order.

Why: the torch code made five passes over the activations (absmax, divide, round, clamp, cast) and three over
the int32 result, 40 % of the int8 model's time, and ``torch._int_mm`` reads the int8 weight at 10-30 GB/s for
1-16 rows (decode), slower than the bf16 GEMM reads twice the bytes (docs/benchmarks.md). The native GEMM
reads the packed weight once per call and applies both scales and the bias in its epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_native

PANEL = 64  # output columns per packed panel (int8_gemm.h)
OFFSET = 128  # the VNNI GEMM reads activations as unsigned codes q + 128
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_OUT_INT32 = 2


@dataclass
class PackedInt8Weight:
    """An int8 weight in the native GEMM's layout, with what its epilogue reads, all padded to whole panels."""

    packed: torch.Tensor  # int8 [panels, k4, 64, 4]
    correction: torch.Tensor  # int32 [panels * 64]: 128 * the column's sum of weights
    scale: torch.Tensor  # fp32 [panels * 64]
    bias: torch.Tensor | None  # fp32 [panels * 64]
    in_features: int
    out_features: int


def native_available() -> bool:
    return cpu_native.ops is not None


# Where the CPU has AMX, oneDNN's AMX kernels behind torch._int_mm do many times the work per cycle of
# AVX-512 VNNI: batches of more rows than this take them (None: none do). 16 until a model's int8 layers are
# measured at load (kernels/cpu_int8_route.py); on this project's Zen 5 (no AMX) the packed GEMM matched
# torch._int_mm from 256 rows up and was faster below.
AMX_PACKED_MAX_ROWS: int | None = 16
AMX_ROUTE_SOURCE = "default"
_IS_AMX = "amx_int8" in cpu_native.cpu_flags()


def is_amx() -> bool:
    return _IS_AMX


def set_amx_packed_max_rows(rows: int | None, source: str = "calibrated") -> None:
    """On an AMX CPU, batches of more than ``rows`` rows go to torch._int_mm (None: every batch takes the packed GEMM)."""
    global AMX_PACKED_MAX_ROWS, AMX_ROUTE_SOURCE
    AMX_PACKED_MAX_ROWS, AMX_ROUTE_SOURCE = rows, source


def describe_amx_route() -> str | None:
    """Where an AMX CPU's int8 batches go, for the kernel set's name; None without AMX (the packed GEMM takes all)."""
    if not _IS_AMX:
        return None
    route = ("int8 packed GEMM for every batch" if AMX_PACKED_MAX_ROWS is None
             else f"int8 batches over {AMX_PACKED_MAX_ROWS} rows on torch._int_mm (AMX)")
    return f"{route} ({AMX_ROUTE_SOURCE})"


def packed_gemm_preferred(rows: int) -> bool:
    """Whether ``rows`` rows take the packed native GEMM (else torch._int_mm between the native passes)."""
    return not _IS_AMX or AMX_PACKED_MAX_ROWS is None or rows <= AMX_PACKED_MAX_ROWS


def packed_gemm_takes_every_batch() -> bool:
    """Whether every batch takes the packed GEMM (no AMX), so that the int8 ``[in, out]`` layout need not be kept."""
    return not _IS_AMX


def native_activation_dtype(dtype: torch.dtype) -> bool:
    """Whether the native quantize / rescale passes take activations of ``dtype``."""
    return dtype in _DTYPE_CODES


def native_gemm_available() -> bool:
    """Whether the native int8 GEMM runs here (a VNNI CPU, or a test that chose the portable body)."""
    return cpu_native.ops is not None and cpu_native.ops.int8_gemm_isa() is not None


def native_quantize_available(x: torch.Tensor) -> bool:
    """Whether the native quantize / rescale passes take these activations: CPU rows of fp32 or bf16."""
    return (cpu_native.ops is not None and x.device.type == "cpu" and native_activation_dtype(x.dtype) and x.dim() == 2
            and x.stride(-1) == 1)


def pack(weight_q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> PackedInt8Weight:
    """int8 ``[out, in]`` (any strides), fp32 scales ``[out]`` (or ``[out, 1]``), optional bias -> the packed form."""
    out_features, in_features = weight_q.shape
    k4 = -(-in_features // 4)
    panels = -(-out_features // PANEL)
    padded = F.pad(weight_q, (0, 4 * k4 - in_features, 0, panels * PANEL - out_features))  # [panels * 64, 4 * k4]
    packed = padded.view(panels, PANEL, k4, 4).permute(0, 2, 1, 3).contiguous()  # [panels, k4, 64, 4]
    correction = padded.sum(dim=1, dtype=torch.int32).mul_(OFFSET)  # [panels * 64]

    def padded_row(values: torch.Tensor) -> torch.Tensor:
        return F.pad(values.reshape(-1).float(), (0, panels * PANEL - out_features)).contiguous()

    return PackedInt8Weight(packed, correction, padded_row(scale), None if bias is None else padded_row(bias),
                            in_features, out_features)


def quantize(x: torch.Tensor, static_scale: torch.Tensor | None = None, offset: int = 0,
             padded_cols: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, cols]`` fp32/bf16 -> (codes ``[rows, padded_cols]``, fp32 scales ``[rows, 1]`` or the static one):
    codes are q + offset as bytes (int8 for offset 0, uint8 for 128), columns past ``cols`` the code of zero."""
    rows, cols = x.shape
    padded_cols = cols if padded_cols is None else padded_cols
    codes = torch.empty((rows, padded_cols), dtype=torch.int8 if offset == 0 else torch.uint8)
    scales = torch.empty((rows, 1), dtype=torch.float32) if static_scale is None else static_scale
    cpu_native.ops.quantize_int8(
        x.data_ptr(), codes.data_ptr(), scales.data_ptr() if static_scale is None else 0, rows, x.stride(0),
        padded_cols, 0.0 if static_scale is None else float(static_scale), cols, padded_cols, offset,
        _DTYPE_CODES[x.dtype], torch.get_num_threads())
    return codes, scales


def rescale(acc: torch.Tensor, x_scale: torch.Tensor, scale_row: torch.Tensor, bias: torch.Tensor | None,
            out_dtype: torch.dtype) -> torch.Tensor:
    """int32 ``[rows, out]`` -> ``out_dtype``: ``acc * x_scale * scale_row (+ bias)``, each product rounded to fp32."""
    rows, cols = acc.shape
    out = torch.empty((rows, cols), dtype=out_dtype)
    cpu_native.ops.rescale_int8(
        acc.data_ptr(), x_scale.data_ptr(), scale_row.data_ptr(), 0 if bias is None else bias.data_ptr(),
        out.data_ptr(), rows, acc.stride(0), 0 if x_scale.numel() == 1 else 1, cols, cols, _DTYPE_CODES[out_dtype],
        torch.get_num_threads())
    return out


def gemm(codes: torch.Tensor, weight: PackedInt8Weight, x_scale: torch.Tensor | None,
         out_dtype: torch.dtype) -> torch.Tensor:
    """uint8 codes ``[rows, 4 * k4]`` (q + 128) x the packed weight -> ``[rows, out]``: int32 when ``out_dtype``
    is ``torch.int32`` (the bare product), else rescaled by ``x_scale`` (per row or one) and the weight's scales."""
    rows = codes.shape[0]
    out = torch.empty((rows, weight.out_features), dtype=out_dtype)
    is_int32 = out_dtype == torch.int32
    cpu_native.ops.int8_gemm(
        codes.data_ptr(), weight.packed.data_ptr(), weight.correction.data_ptr(),
        0 if is_int32 else x_scale.data_ptr(), weight.scale.data_ptr(),
        0 if weight.bias is None or is_int32 else weight.bias.data_ptr(), out.data_ptr(), rows, codes.stride(0),
        0 if is_int32 or x_scale.numel() == 1 else 1, weight.out_features, weight.out_features,
        weight.packed.shape[1], _OUT_INT32 if is_int32 else _DTYPE_CODES[out_dtype], torch.get_num_threads())
    return out


def packed_product(x: torch.Tensor, weight: PackedInt8Weight, static_scale: torch.Tensor | None,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """``[rows, in]`` fp32/bf16 x the packed weight -> ``out_dtype`` ``[rows, out]``: quantized per row (or by the
    static scale), the int8 GEMM, both scales and the bias, in two native calls."""
    codes, x_scale = quantize(x, static_scale, OFFSET, 4 * weight.packed.shape[1])
    return gemm(codes, weight, x_scale, out_dtype)


def unpacked_product(x: torch.Tensor, weight_t: torch.Tensor, scale_row: torch.Tensor, bias: torch.Tensor | None,
                     static_scale: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The same through ``torch._int_mm`` on int8 ``[in, out]`` (CPUs without VNNI: oneDNN picks its kernel)."""
    codes, x_scale = quantize(x, static_scale)
    return rescale(torch._int_mm(codes, weight_t), x_scale, scale_row, bias, out_dtype)
