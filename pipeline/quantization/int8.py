"""W8A8 int8 linear layers: int8 weights with one scale per output channel, activations quantized per token.

``y = (q(x) @ W_q^T) * s_x * s_w (+ b)``: the activations are quantized to int8 on the fly (one scale per
token, absmax / 127, or the checkpoint's static per-tensor ``input_scale``), the product runs as an int8 x int8
-> int32 GEMM, and the int32 result is scaled back in fp32. The torch functions below are that arithmetic
(``torch._int_mm``: cuBLASLt on CUDA, oneDNN on the CPU) and the oracle of the native CPU path
(``kernels/cpu_int8.py``), which gives the same results bit for bit: one quantize pass over the activations, and
on a CPU with AVX-512 VNNI a GEMM over a weight packed once at load that applies the scales and the bias itself
(else ``torch._int_mm`` between the native quantize and rescale passes). The weights stay int8 in memory (a
quarter of fp32; on the CPU the packed copy beside the plain one makes it half).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_int8
from pipeline.models.layers import empty_parameter

INT8_MAX = 127.0
_MIN_SCALE = 1e-12  # an all-zero row or weight channel gets this scale instead of dividing by zero
_CUDA_MIN_ROWS = 17  # cuBLASLt's int8 GEMM in torch._int_mm wants more than 16 rows


def quantize_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: ``[rows, cols]`` float -> (int8 ``[rows, cols]``, fp32 scales ``[rows, 1]``)."""
    absmax = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)  # [rows, 1]
    scale = absmax.clamp_(min=_MIN_SCALE) / INT8_MAX
    return quantize_with_scale(x, scale), scale


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 values of ``x`` under a given (static) scale, divided in fp32 (a bf16 ``x`` by a 0-dim scale would
    otherwise be divided in bf16, torch's type promotion, and its quotient rounded to bf16 before rounding to int8)."""
    quotient = torch.div(x.to(torch.float32), scale, out=torch.empty_like(x, dtype=torch.float32))
    return quotient.round_().clamp_(-128, 127).to(torch.int8)


def int8_gemm(x_q: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """``[rows, in]`` int8 x ``[in, out]`` int8 -> int32 ``[rows, out]`` (padded to cuBLASLt's minimum on CUDA)."""
    rows = x_q.shape[0]
    if x_q.is_cuda and rows < _CUDA_MIN_ROWS:
        return torch._int_mm(F.pad(x_q, (0, 0, 0, _CUDA_MIN_ROWS - rows)), weight_t)[:rows]
    return torch._int_mm(x_q, weight_t)


def int8_product(x: torch.Tensor, weight_t: torch.Tensor, weight_scale_row: torch.Tensor,
                 act_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``[rows, in]`` float x (int8 ``[in, out]`` with fp32 ``[1, out]`` scales) -> fp32 ``[rows, out]``: the
    activations quantized on the fly (per row, or by the static ``act_scale``), the product in int8 -> int32,
    both scales applied (torch ops: CUDA, and the CPU without the native module)."""
    if act_scale is None:
        x_q, x_scale = quantize_per_row(x)  # [rows, in] int8, [rows, 1] fp32
    else:
        x_q, x_scale = quantize_with_scale(x, act_scale), act_scale
    return int8_gemm(x_q.contiguous(), weight_t).float().mul_(x_scale).mul_(weight_scale_row)


class Int8Matrix:
    """One int8 weight with its scales per output channel (and bias): ``matrix(x)`` is ``int8_product`` (+ bias)
    in ``out_dtype``, through the native CPU kernels where they apply (the same values).

    Where the packed native GEMM takes every call (a VNNI CPU without AMX, activations in ``activation_dtype``
    that the native passes take) the ``[in, out]`` layout is not kept: ``weight_t`` is None and the int8
    weights are held once.
    """

    def __init__(self, weight_t: torch.Tensor, scale_row: torch.Tensor, bias: torch.Tensor | None = None,
                 act_scale: torch.Tensor | None = None, activation_dtype: torch.dtype | None = None):
        self.scale_row = scale_row  # fp32 [1, out]
        self.bias = bias  # [out] in the model dtype, or None
        self.act_scale = act_scale  # fp32 scalar, or None: per token
        self.out_features = weight_t.shape[1]
        is_cpu = weight_t.device.type == "cpu"
        # a static scale of zero (or less) divides as torch divides: leave it to the torch ops
        self.is_native = is_cpu and cpu_int8.native_available() and (act_scale is None or float(act_scale) > 0)
        self.bias_fp32 = None if bias is None or not self.is_native else bias.float().contiguous()
        self.packed = (cpu_int8.pack(weight_t.t(), scale_row, bias)
                       if self.is_native and cpu_int8.native_gemm_available() else None)
        takes_every_call = (self.packed is not None and cpu_int8.packed_gemm_takes_every_batch()
                            and activation_dtype is not None and cpu_int8.native_activation_dtype(activation_dtype))
        self.weight_t = None if takes_every_call else weight_t  # int8 [in, out], or None: only the packed copy

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:  # [..., in] -> [..., out]
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])  # [rows, in]
        if self.is_native and x.stride(-1) != 1:
            x = x.contiguous()
        if self.is_native and cpu_int8.native_quantize_available(x):
            if self.packed is not None and cpu_int8.packed_gemm_preferred(x.shape[0]):  # always, where no weight_t
                out = cpu_int8.packed_product(x, self.packed, self.act_scale, out_dtype)
            else:
                out = cpu_int8.unpacked_product(x, self.weight_t, self.scale_row, self.bias_fp32, self.act_scale,
                                                out_dtype)
        else:
            out = int8_product(x, self.weight_t, self.scale_row, self.act_scale)  # [rows, out] fp32
            if self.bias is not None:
                out = out.add_(self.bias)
            out = out.to(out_dtype)
        return out.view(*lead, self.out_features)


class Int8Linear(nn.Module):
    """A ``layers.Linear`` whose product runs in int8 (same ``shard_sizes``, bias and checkpoint names).

    Loaded either from a W8A8 checkpoint (``is_prequantized``: ``weight`` int8 ``[out, in]``, ``weight_scale``
    ``[out, 1]``, with ``static_input`` also ``input_scale`` ``[out, 1]``, a per-tensor scale repeated over
    its rows by the loader's stream) or from float weights quantized in ``finish_loading`` (``--quantization
    int8``). ``finish_loading`` runs once every tensor is in.
    """

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool, dtype: torch.dtype, device,
                 is_prequantized: bool, static_input: bool = False):
        super().__init__()
        self.shard_sizes = list(shard_sizes)
        self.dtype = dtype
        out_features = sum(self.shard_sizes)
        self.is_prequantized = is_prequantized
        weight_dtype = torch.int8 if is_prequantized else dtype
        self.weight = empty_parameter(out_features, in_features, dtype=weight_dtype, device=device)  # [out, in]
        self.bias = empty_parameter(out_features, dtype=dtype, device=device) if bias else None
        if is_prequantized:
            self.weight_scale = empty_parameter(out_features, 1, dtype=torch.float32, device=device)  # [out, 1]
            if static_input:  # every part sees the same input: their scales agree (the largest is used)
                self.input_scale = empty_parameter(out_features, 1, dtype=torch.float32, device=device)
        self.static_input = is_prequantized and static_input
        self.weight_t = None  # int8 [in, out], what torch._int_mm reads (None where only the packed copy is kept)
        self.scale_row = None  # fp32 [1, out]: the weight's scale per output channel
        self.act_scale = None  # fp32 scalar: the static activation scale, None = per token
        self.matrix = None  # Int8Matrix: the product, from the layouts above (and a packed one on the CPU)

    @torch.no_grad()
    def finish_loading(self) -> None:
        """Quantize float weights (``--quantization int8``) and lay the weights out for the GEMM."""
        if self.is_prequantized:
            weight_q, scale = self.weight.data, self.weight_scale.data.float()
            if self.static_input:
                self.act_scale = self.input_scale.data.float().max()
        else:
            weight_q, scale = quantize_per_row(self.weight.data)  # [out, in], [out, 1]
        weight_t = weight_q.t().contiguous()  # [in, out]
        self.scale_row = scale.reshape(1, -1).contiguous()  # [1, out]
        if not self.is_prequantized:
            self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.matrix = Int8Matrix(weight_t, self.scale_row, None if self.bias is None else self.bias.data,
                                 self.act_scale, activation_dtype=self.dtype)
        # one int8 copy: the parameter becomes a view of the GEMM's [in, out] layout, or, where the packed copy
        # takes every call and the matrix kept no other, keeps only its shape (the meta device)
        self.weight_t = self.matrix.weight_t
        self.weight = nn.Parameter(weight_t.t() if self.weight_t is not None else
                                   torch.empty(weight_q.shape, dtype=torch.int8, device="meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        return self.matrix(x, self.dtype)

    def extra_repr(self) -> str:
        kind = "static" if self.static_input else "per-token"
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, activations={kind}"
