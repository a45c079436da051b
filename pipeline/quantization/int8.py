"""W8A8 int8 linear layers: int8 weights with one scale per output channel, activations quantized per token.

``y = (q(x) @ W_q^T) * s_x * s_w (+ b)``: the activations are quantized to int8 on the fly (one scale per
token, absmax / 127, or the checkpoint's static per-tensor ``input_scale``), the product runs as an int8 x int8
-> int32 GEMM (``torch._int_mm``: oneDNN on the CPU, which picks the VNNI / AMX kernels itself; cuBLASLt on
CUDA), and the int32 result is scaled back in fp32. The weights stay int8 in memory (a quarter of fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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
    """int8 values of ``x`` under a given (static) scale."""
    return torch.div(x, scale, out=torch.empty_like(x, dtype=torch.float32)).round_().clamp_(-128, 127).to(torch.int8)


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
    both scales applied."""
    if act_scale is None:
        x_q, x_scale = quantize_per_row(x)  # [rows, in] int8, [rows, 1] fp32
    else:
        x_q, x_scale = quantize_with_scale(x, act_scale), act_scale
    return int8_gemm(x_q.contiguous(), weight_t).float().mul_(x_scale).mul_(weight_scale_row)


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
        self.weight_t = None  # int8 [in, out], what the GEMM reads
        self.scale_row = None  # fp32 [1, out]: the weight's scale per output channel
        self.act_scale = None  # fp32 scalar: the static activation scale, None = per token

    @torch.no_grad()
    def finish_loading(self) -> None:
        """Quantize float weights (``--quantization int8``) and lay the weights out for the GEMM."""
        if self.is_prequantized:
            weight_q, scale = self.weight.data, self.weight_scale.data.float()
            if self.static_input:
                self.act_scale = self.input_scale.data.float().max()
        else:
            weight_q, scale = quantize_per_row(self.weight.data)  # [out, in], [out, 1]
        self.weight_t = weight_q.t().contiguous()  # [in, out]
        self.scale_row = scale.reshape(1, -1).contiguous()  # [1, out]
        # one int8 copy: the parameter becomes a view of the GEMM's layout
        self.weight = nn.Parameter(self.weight_t.t(), requires_grad=False)
        if not self.is_prequantized:
            self.weight_scale = nn.Parameter(scale, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        out = int8_product(x, self.weight_t, self.scale_row, self.act_scale)  # [num_tokens, out] fp32
        if self.bias is not None:
            out = out.add_(self.bias)
        return out.to(self.dtype)

    def extra_repr(self) -> str:
        kind = "static" if self.static_input else "per-token"
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, activations={kind}"
