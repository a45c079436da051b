"""DeepSeek-V3's mixture-of-experts MLP: grouped, bias-corrected sigmoid routing, routed experts and shared experts.

Routing follows transformers' ``DeepseekV3TopkRouter`` step by step, in fp32 whatever the model dtype (the
router's weight and bias stay fp32, as transformers keeps them): sigmoid scores; the correction bias is
added for the choice only; experts are split into ``n_group`` groups, each group scored by the sum of its
two best biased scores, the ``topk_group`` best groups kept; the top-k experts among them are chosen,
weighted by their unbiased scores (divided by their sum when ``norm_topk_prob``), times
``routed_scaling_factor``. The routed experts run grouped (``kernels.fused_moe``, stacked as in ``moe.py``);
the shared experts are one dense gated MLP of ``moe_intermediate_size * n_shared_experts`` over every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import Kernels
from pipeline.checkpoint_errors import CheckpointError
from pipeline.models.layers import empty_parameter
from pipeline.models.llama import MLP
from pipeline.models.moe import MoeSpec, StackedExperts


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek's routing switches: expert groups, groups kept per token, and the routed weights' scale."""

    num_groups: int  # n_group
    num_kept_groups: int  # topk_group
    routed_scaling_factor: float


def deepseek_moe_spec(hf_config) -> MoeSpec:
    """The routed experts of a DeepSeek-V3 config; checkpoints name them ``mlp.experts.N.{gate,up,down}_proj``."""
    return MoeSpec(
        num_experts=hf_config.n_routed_experts, top_k=hf_config.num_experts_per_tok,
        intermediate_size=hf_config.moe_intermediate_size, renormalize=bool(hf_config.norm_topk_prob),
        weights_in_fp32=True, block_name="mlp", projection_names=("gate_proj", "up_proj", "down_proj"),
    )


def grouped_routing(hf_config) -> GroupedRouting:
    num_experts, num_groups = hf_config.n_routed_experts, hf_config.n_group
    if num_experts % num_groups or num_experts // num_groups < 2:
        raise CheckpointError(f"n_group {num_groups} must split n_routed_experts {num_experts} into groups of >= 2")
    return GroupedRouting(num_groups, hf_config.topk_group, float(hf_config.routed_scaling_factor))


def route_grouped(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [num_experts, hidden] fp32
    correction_bias: torch.Tensor,  # [num_experts] fp32
    spec: MoeSpec,
    routing: GroupedRouting,
) -> tuple[torch.Tensor, torch.Tensor]:  # fp32 weights and expert ids, each [num_tokens, top_k]
    scores = F.linear(hidden.float(), weight.float()).sigmoid()  # [num_tokens, num_experts]
    biased = scores + correction_bias
    group_size = spec.num_experts // routing.num_groups
    # [num_tokens, num_groups]: each group scored by its two best biased scores
    group_scores = biased.view(-1, routing.num_groups, group_size).topk(2, dim=-1)[0].sum(dim=-1)
    kept_groups = torch.topk(group_scores, k=routing.num_kept_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, kept_groups, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, routing.num_groups, group_size).reshape(-1, spec.num_experts)
    biased = biased.masked_fill(~expert_mask.bool(), float("-inf"))
    expert_ids = torch.topk(biased, k=spec.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, expert_ids)
    if spec.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.routed_scaling_factor, expert_ids


class GroupedTopkRouter(nn.Module):
    """The router (``mlp.gate``): its weight and score correction bias, fp32 in every model dtype."""

    def __init__(self, hidden_size: int, num_experts: int, device):
        super().__init__()
        self.weight = empty_parameter(num_experts, hidden_size, dtype=torch.float32, device=device)
        self.e_score_correction_bias = empty_parameter(num_experts, dtype=torch.float32, device=device)


class DeepseekMoe(nn.Module):
    """Routed experts (``experts``, stacked) chosen by ``gate``, plus the always-on ``shared_experts``."""

    def __init__(self, hf_config, dtype: torch.dtype, device):
        super().__init__()
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise CheckpointError(f"hidden_act {hf_config.hidden_act!r} is not supported (only silu)")
        self.spec, self.routing = deepseek_moe_spec(hf_config), grouped_routing(hf_config)
        self.gate = GroupedTopkRouter(hf_config.hidden_size, self.spec.num_experts, device)
        self.experts = StackedExperts(self.spec, hf_config.hidden_size, dtype, device)
        shared_size = hf_config.moe_intermediate_size * hf_config.n_shared_experts
        self.shared_experts = MLP(hf_config, dtype, device, intermediate_size=shared_size)

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:  # [num_tokens, hidden]
        weights, expert_ids = route_grouped(x, self.gate.weight, self.gate.e_score_correction_bias, self.spec,
                                            self.routing)  # [num_tokens, top_k] each
        routed = self.experts(x, weights, expert_ids, kernels)
        return routed + self.shared_experts(x, kernels)
