"""The mixture-of-experts MLP kind: a router picks each token's top-k experts, the experts run grouped by expert.

Routing follows transformers' modeling files step by step (softmax in fp32, top-k, renormalised where
the family does it); the experts' work is the kernel set's ``fused_moe`` (tokens sorted by expert, one
GEMM per expert, weighted sum back). Expert weights are stacked once at load into
``gate_up_proj [num_experts, 2 * intermediate, hidden]`` and ``down_proj [num_experts, hidden,
intermediate]``, transformers' own in-memory layout, whichever of its two on-disk layouts the checkpoint
has: one tensor per expert and projection (what ``save_pretrained`` writes by default) or the stacked
tensors themselves (``save_pretrained(save_original_format=False)``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from kernels import Kernels
from kernels.moe_ref import experts_over_grouped_rows
from pipeline.checkpoint_errors import CheckpointError
from pipeline.models.layers import Linear, WeightSlot, empty_parameter


@dataclass(frozen=True)
class MoeSpec:
    """One family's sparse MLP: sizes, routing, and how its checkpoints name the experts' tensors."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    renormalize: bool  # the top-k weights divided by their sum
    weights_in_fp32: bool  # routing weights kept fp32 (Mixtral) or cast to the model dtype (Qwen3-MoE)
    block_name: str  # the checkpoint's name of the sparse block: "mlp" or "block_sparse_moe"
    projection_names: tuple[str, str, str]  # the checkpoint's gate, up and down names per expert


def route(router_logits: torch.Tensor, spec: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num_tokens, num_experts]`` logits -> (weights, expert ids), each ``[num_tokens, top_k]``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if spec.weights_in_fp32 else weights.to(router_logits.dtype)), expert_ids


class StackedExperts(nn.Module):
    """Every expert's gate/up and down projections, stacked: one tensor each, as the grouped GEMM reads them."""

    def __init__(self, spec: MoeSpec, hidden_size: int, dtype: torch.dtype, device):
        super().__init__()
        num_experts, intermediate = spec.num_experts, spec.intermediate_size
        self.shard_sizes = [intermediate, intermediate]  # gate_up_proj's row blocks: gate, then up
        self.gate_up_proj = empty_parameter(num_experts, 2 * intermediate, hidden_size, dtype=dtype, device=device)
        self.down_proj = empty_parameter(num_experts, hidden_size, intermediate, dtype=dtype, device=device)
        # per expert, (gate_up, down) GEMMs the kernel set prepared (the CPU set: oneDNN with packed weights,
        # ``kernels.cpu_backend.prepare_model_cpu``); None: the kernel set's ``fused_moe`` over the stacked weights, or,
        # with ``grouped_experts`` set, that takes every group (the stacked weights then kept only as shapes)
        self.expert_gemms: list[tuple[Callable, Callable]] | None = None
        # all experts' GEMMs in one native call each (the CPU set in bf16, ``kernels.cpu_moe``): (grouped rows, rows
        # per expert, silu_and_mul) -> their outputs, or None where the groups are too large for it (the loop above)
        self.grouped_experts: Callable | None = None

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                kernels: Kernels) -> torch.Tensor:  # [num_tokens, hidden]: each token's top-k experts, weighted
        if self.expert_gemms is None and self.grouped_experts is None:
            return kernels.fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)

        def expert(index: int, rows: torch.Tensor) -> torch.Tensor:  # [count, hidden] -> [count, hidden]
            if self.expert_gemms is None:  # grouped_experts was to take every group: the stacked experts are gone
                raise RuntimeError("the grouped expert GEMM declined a group it was prepared to take")
            gate_up, down = self.expert_gemms[index]
            return down(kernels.silu_and_mul(gate_up(rows)))

        def all_experts(grouped: torch.Tensor, rows_per_expert: torch.Tensor) -> torch.Tensor | None:
            return self.grouped_experts(grouped, rows_per_expert, kernels.silu_and_mul)

        return experts_over_grouped_rows(x, topk_weights, topk_ids, self.gate_up_proj.shape[0], expert,
                                         None if self.grouped_experts is None else all_experts,
                                         kernels.combine_grouped_rows)


class SparseMoeBlock(nn.Module):
    """The MoE MLP: ``gate`` (the router, ``[num_experts, hidden]``) and the stacked ``experts``."""

    def __init__(self, hf_config, spec: MoeSpec, dtype: torch.dtype, device):
        super().__init__()
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise CheckpointError(f"hidden_act {hf_config.hidden_act!r} is not supported (only silu)")
        self.spec = spec
        self.gate = Linear(hf_config.hidden_size, [spec.num_experts], False, dtype, device)
        self.experts = StackedExperts(spec, hf_config.hidden_size, dtype, device)

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:  # [num_tokens, hidden]
        topk_weights, topk_ids = route(self.gate(x), self.spec)  # [num_tokens, top_k] each
        return self.experts(x, topk_weights, topk_ids, kernels)


# Checkpoint names of a sparse block's tensors: per expert, stacked, and the router.
_PER_EXPERT = re.compile(r"^(?P<layer>.+)\.(?P<block>[^.]+)\.experts\.(?P<expert>\d+)\.(?P<proj>[^.]+)\.weight$")
_STACKED = re.compile(r"^(?P<layer>.+)\.mlp\.experts\.(?P<proj>gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(?P<layer>.+)\.(?P<block>[^.]+)\.gate\.weight$")


def expert_slot(checkpoint_name: str, spec: MoeSpec) -> WeightSlot | None:
    """The slot of a sparse block's checkpoint tensor (either layout), or None for any other tensor."""
    gate, up, down = spec.projection_names
    if match := _PER_EXPERT.match(checkpoint_name):
        if match["block"] == spec.block_name and match["proj"] in (gate, up, down):
            param = "gate_up_proj" if match["proj"] != down else "down_proj"
            part = {gate: 0, up: 1}.get(match["proj"])
            return WeightSlot(f"{match['layer']}.mlp.experts.{param}", int(match["expert"]), part)
    elif match := _STACKED.match(checkpoint_name):
        return WeightSlot(checkpoint_name)
    elif (match := _ROUTER.match(checkpoint_name)) and match["block"] == spec.block_name:
        return WeightSlot(f"{match['layer']}.mlp.gate.weight")
    return None


def expert_checkpoint_names(param_name: str, spec: MoeSpec) -> list[str] | None:
    """The per-expert checkpoint names (the default layout) that fill a sparse block's parameter; None for others."""
    gate, up, down = spec.projection_names
    if match := _STACKED.match(param_name):
        projections = (gate, up) if match["proj"] == "gate_up_proj" else (down,)
        block = f"{match['layer']}.{spec.block_name}.experts"
        return [f"{block}.{expert}.{proj}.weight" for expert in range(spec.num_experts) for proj in projections]
    if (match := _ROUTER.match(param_name)) and match["block"] == "mlp":
        return [f"{match['layer']}.{spec.block_name}.gate.weight"]
    return None

