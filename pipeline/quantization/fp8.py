"""fp8 linear layers for GPUs with fp8 tensor cores: float8 weights and activations through ``torch._scaled_mm``.

``y = _scaled_mm(q(x), W_q^T, s_x, s_w) (+ b)``: each token's activations are scaled into float8_e4m3fn's range
on the fly (absmax / 448, or the checkpoint's static ``input_scale``), the weights stay float8 in memory, and the
product is accumulated by the GPU with both scales applied per row / per output channel (``_scaled_mm``'s
rowwise scaling). Used only where ``fp8_gemm_available`` says so (CUDA, compute capability 9.0 or newer); on the
CPU, which has no fp8 GEMM, fp8 checkpoints are dequantized at load instead (``dequantize.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.models.layers import empty_parameter

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
_MIN_SCALE = 1e-12
_GEMM_MULTIPLE = 16  # _scaled_mm's kernels want both weight dimensions in multiples of 16


def fp8_gemm_available(device) -> bool:
    """Whether ``device`` runs fp8 GEMMs natively (Hopper / Blackwell GPUs)."""
    device = torch.device(device)
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (9, 0))


def fits_fp8_gemm(in_features: int, out_features: int) -> bool:
    return in_features % _GEMM_MULTIPLE == 0 and out_features % _GEMM_MULTIPLE == 0


def quantize_fp8_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, cols]`` -> (float8 ``[rows, cols]``, fp32 scales ``[rows, 1]``)."""
    absmax = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)  # [rows, 1]
    scale = absmax.clamp_(min=_MIN_SCALE) / FP8_MAX
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


class Fp8Linear(nn.Module):
    """A ``layers.Linear`` whose product runs in fp8: ``weight`` float8 ``[out, in]``, ``weight_scale``
    ``[out, 1]`` and, with ``static_input``, ``input_scale`` ``[out, 1]`` (a per-tensor scale repeated over its
    rows by the loader's stream, so a fused projection's parts stay row blocks)."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool, dtype: torch.dtype, device,
                 static_input: bool = False):
        super().__init__()
        self.shard_sizes = list(shard_sizes)
        self.dtype = dtype
        out_features = sum(self.shard_sizes)
        self.weight = empty_parameter(out_features, in_features, dtype=FP8_DTYPE, device=device)  # [out, in]
        self.weight_scale = empty_parameter(out_features, 1, dtype=torch.float32, device=device)  # [out, 1]
        if static_input:  # every part sees the same input: their scales agree (the largest is used)
            self.input_scale = empty_parameter(out_features, 1, dtype=torch.float32, device=device)
        self.static_input = static_input
        self.bias = empty_parameter(out_features, dtype=dtype, device=device) if bias else None
        self.scale_row = None  # fp32 [1, out]
        self.act_scale = None  # fp32 scalar: the static activation scale, None = per token

    @torch.no_grad()
    def finish_loading(self) -> None:
        self.scale_row = self.weight_scale.data.float().reshape(1, -1).contiguous()  # [1, out]
        if self.static_input:
            self.act_scale = self.input_scale.data.float().max()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        if self.act_scale is None:
            x_q, x_scale = quantize_fp8_per_row(x)  # [num_tokens, in], [num_tokens, 1]
        else:
            x_q = (x.float() / self.act_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            x_scale = self.act_scale.expand(x.shape[0], 1).contiguous()
        # weight.t(): [in, out] column-major, the layout _scaled_mm wants for its second operand
        out = torch._scaled_mm(x_q, self.weight.t(), scale_a=x_scale, scale_b=self.scale_row,
                               out_dtype=torch.bfloat16)
        if self.bias is not None:
            out = out.float().add_(self.bias)
        return out.to(self.dtype)

    def extra_repr(self) -> str:
        kind = "static" if self.static_input else "per-token"
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, activations={kind}"
