"""gpt-oss (``GptOssForCausalLM``) over flat batches and the paged KV cache.

Built from the Llama family's parts (``llama.py``: attention, norms, RoPE, checkpoint loading and the
logits) with gpt-oss's switches, each as transformers' modeling file has it:

- attention has biases on q/k/v/o, GQA, and learned per-head attention sinks (one logit per query head in
  the softmax's denominator; ``Attention`` adds them for a gpt_oss config), on layers that are sliding
  window or full as ``layer_types`` says (``llama._sliding_windows``); RoPE is the config's (yarn);
- every MLP is the mixture-of-experts block here: a router with a bias, top-k of its logits and a softmax
  over the selected ones, and experts with biased projections and a clamped SwiGLU,
  ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=limit)``.

transformers stores the experts transposed and with gate and up interleaved (``gate_up_proj [experts,
hidden, 2 * intermediate]``: gate columns even, up columns odd; ``down_proj [experts, intermediate,
hidden]``); they are laid out once at load as the grouped GEMM reads them, ``[experts, 2 * intermediate,
hidden]`` with the gate block first, and ``[experts, hidden, intermediate]``. MXFP4-quantized checkpoints
(the hub's originals) reach ``load_weights`` already dequantized to that float layout
(``pipeline/quantization/mxfp4.py``).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from kernels import Kernels
from kernels.gpt_oss_moe_ref import clamped_swiglu_expert
from kernels.moe_ref import experts_over_grouped_rows
from pipeline.checkpoint_errors import CheckpointError
from pipeline.models.layers import Linear, empty_parameter
from pipeline.models.llama import LlamaFamilyForCausalLM


class GptOssExperts(nn.Module):
    """Every expert's biased gate/up and down projections, stacked (gate block first, then up)."""

    def __init__(self, hf_config, dtype: torch.dtype, device):
        super().__init__()
        num_experts, hidden = hf_config.num_local_experts, hf_config.hidden_size
        intermediate = hf_config.intermediate_size  # of each expert
        self.gate_up_proj = empty_parameter(num_experts, 2 * intermediate, hidden, dtype=dtype, device=device)
        self.gate_up_proj_bias = empty_parameter(num_experts, 2 * intermediate, dtype=dtype, device=device)
        self.down_proj = empty_parameter(num_experts, hidden, intermediate, dtype=dtype, device=device)
        self.down_proj_bias = empty_parameter(num_experts, hidden, dtype=dtype, device=device)
        # all experts' GEMMs in one native call each, biases included (the CPU set in bf16, ``kernels.cpu_moe``):
        # (grouped rows, rows per expert, activation) -> their outputs, or None where the groups are too large for it
        self.grouped_experts: Callable | None = None


class GptOssMoeBlock(nn.Module):
    """gpt-oss's MLP: the biased ``router`` (``[num_experts, hidden]``) and the stacked ``experts``."""

    def __init__(self, hf_config, dtype: torch.dtype, device):
        super().__init__()
        self.top_k = hf_config.num_experts_per_tok
        self.alpha, self.limit = float(hf_config.swiglu_alpha), float(hf_config.swiglu_limit)
        self.router = Linear(hf_config.hidden_size, [hf_config.num_local_experts], True, dtype, device)
        self.experts = GptOssExperts(hf_config, dtype, device)

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:  # [num_tokens, hidden]
        router_logits = self.router(x)  # [num_tokens, num_experts]
        # transformers' GptOssTopKRouter: top-k of the logits, then a softmax over those k in their dtype
        top_logits, topk_ids = torch.topk(router_logits, self.top_k, dim=-1)  # [num_tokens, top_k] each
        topk_weights = torch.softmax(top_logits, dim=-1, dtype=top_logits.dtype)
        experts = self.experts
        if experts.grouped_experts is None:
            return kernels.clamped_swiglu_moe(
                x, experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias,
                topk_weights, topk_ids, self.alpha, self.limit,
            )

        def activation(gate_up: torch.Tensor) -> torch.Tensor:
            return kernels.clamped_swiglu(gate_up, self.alpha, self.limit)

        def expert(index: int, rows: torch.Tensor) -> torch.Tensor:  # groups the one-call path declines (AMX)
            return clamped_swiglu_expert(rows, experts.gate_up_proj[index], experts.gate_up_proj_bias[index],
                                         experts.down_proj[index], experts.down_proj_bias[index], self.alpha,
                                         self.limit, kernels.clamped_swiglu)

        return experts_over_grouped_rows(
            x, topk_weights, topk_ids, experts.gate_up_proj.shape[0], expert,
            lambda grouped, rows_per_expert: experts.grouped_experts(grouped, rows_per_expert, activation),
            kernels.combine_grouped_rows)


def _deinterleave(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """gate/up interleaved along ``dim`` (gate even, up odd) -> the gate block, then the up block."""
    last = tensor.movedim(dim, -1)
    return torch.cat((last[..., 0::2], last[..., 1::2]), dim=-1).movedim(-1, dim)


def to_stacked_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor in the layout Tandem's parameter of the same name has (experts transposed and
    de-interleaved; everything else as stored)."""
    if name.endswith(".mlp.experts.gate_up_proj"):  # [experts, hidden, 2 * intermediate], interleaved
        return _deinterleave(tensor.transpose(1, 2), dim=1)  # [experts, 2 * intermediate, hidden]
    if name.endswith(".mlp.experts.gate_up_proj_bias"):  # [experts, 2 * intermediate], interleaved
        return _deinterleave(tensor, dim=1)
    if name.endswith(".mlp.experts.down_proj"):  # [experts, intermediate, hidden]
        return tensor.transpose(1, 2)  # [experts, hidden, intermediate]
    return tensor


class GptOssForCausalLM(LlamaFamilyForCausalLM):
    """gpt-oss causal LM: ``LlamaFamilyForCausalLM`` (attention with sinks for this config) whose every MLP is a
    ``GptOssMoeBlock``. Parameter names follow the checkpoint's, q/k/v fused as in the Llama family."""

    def __init__(self, hf_config, dtype: torch.dtype, device):
        if hf_config.model_type != "gpt_oss":
            raise CheckpointError(f"GptOssForCausalLM needs a gpt_oss config (got {hf_config.model_type!r})")
        super().__init__(hf_config, dtype, device)

    def build_mlp(self, hf_config, layer_index: int, dtype: torch.dtype, device) -> nn.Module:
        return GptOssMoeBlock(hf_config, dtype, device)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name, to_stacked_layout(name, tensor)) for name, tensor in named_tensors)
