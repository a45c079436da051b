"""A mixture-of-experts layer's stacked experts in W8A8 int8 (``moe.StackedExperts``' int8 form).

Each expert's gate/up and down weights are int8 with one scale per output channel (as ``Int8Linear``'s), kept
transposed per expert (``[experts, in, out]``) for ``torch._int_mm`` and, on the CPU, packed per expert for the
native GEMM (``int8.Int8Matrix``); the rows routed to an expert (grouped as ``kernels.moe_ref`` groups them, one
GEMM pair per expert) are quantized per row on the fly, so each GEMM is int8 x int8 -> int32 and the SwiGLU
between them runs in fp32. Built after loading from the float stacked experts: a W8A8 checkpoint's int8
experts come through the loader dequantized (``w_q * s``) and quantize back under the checkpoint's own scales
``s`` (which the loader keeps) to the same int8 values, bit for bit: ``w_q * s`` rounded to bf16 is within
``|w_q| * 2**-9 <= 0.25`` of ``w_q`` once divided by ``s``. (Quantizing them afresh per row would change every
row whose extreme is not stored as +-127: a -128, a minmax observer's ``absmax / 127.5``, GPTQ's scales.)
``--quantization int8`` quantizes the float ones per row. Resident memory is
int8 (a quarter of fp32, half of bf16; twice that on the CPU, where the packed copy sits beside the plain one);
loading holds the float experts of the model until this replaces them.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import Kernels
from kernels.moe_ref import experts_over_grouped_rows
from pipeline.quantization.int8 import Int8Matrix, quantize_per_row, quantize_with_scale


def _quantized_per_expert(stacked: torch.Tensor, scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[experts, out, in]`` -> (int8 ``[experts, in, out]``, fp32 scales ``[experts, 1, out]``); ``scales``
    (``[experts, out]``): the checkpoint's, else per row from the weights."""
    num_experts, out_features, in_features = stacked.shape
    rows = stacked.reshape(num_experts * out_features, in_features)
    if scales is None:
        weight_q, scale = quantize_per_row(rows)
    else:
        scale = scales.to(torch.float32).reshape(-1, 1)
        weight_q = quantize_with_scale(rows, scale)
    weight_t = weight_q.view(num_experts, out_features, in_features).transpose(1, 2).contiguous()
    return weight_t, scale.view(num_experts, 1, out_features).contiguous()


class Int8StackedExperts(nn.Module):
    """Same call as ``StackedExperts``: ``experts(x, topk_weights, topk_ids, kernels)`` -> ``[num_tokens, hidden]``."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
                 down_scale: torch.Tensor | None = None):
        """``gate_up_scale`` ``[experts, 2 * inter]``, ``down_scale`` ``[experts, hidden]``: a W8A8 checkpoint's
        scales per output row (None: quantized per row here)."""
        super().__init__()
        self.num_experts = gate_up_proj.shape[0]
        self.dtype = gate_up_proj.dtype
        self.gate_up_t, self.gate_up_scale = _quantized_per_expert(gate_up_proj.data, gate_up_scale)  # [e, h, 2 * i]
        self.down_t, self.down_scale = _quantized_per_expert(down_proj.data, down_scale)  # [e, inter, hidden]
        self.matrices = [(Int8Matrix(self.gate_up_t[e], self.gate_up_scale[e]),
                          Int8Matrix(self.down_t[e], self.down_scale[e])) for e in range(self.num_experts)]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                kernels: Kernels) -> torch.Tensor:
        def expert(index: int, rows: torch.Tensor) -> torch.Tensor:  # [count, hidden] -> [count, hidden]
            gate_up, down = self.matrices[index]
            return down(kernels.silu_and_mul(gate_up(rows, torch.float32)), self.dtype)  # via fp32 [count, 2 * inter]

        return experts_over_grouped_rows(x, topk_weights, topk_ids, self.num_experts, expert)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.gate_up_t.shape[1]}, "
                f"intermediate={self.down_t.shape[1]}, activations=per-token int8")
