"""The Llama family with mixture-of-experts MLPs: Qwen3-MoE and Mixtral checkpoints.

Attention, norms, RoPE, the KV cache and the logits are ``llama.py``'s; only the MLP kind changes
(``moe.SparseMoeBlock``), and the families differ in small switches read from the transformers config:
which layers are sparse (Qwen3-MoE's ``decoder_sparse_step`` and ``mlp_only_layers`` leave dense
layers among them; Mixtral is sparse throughout), the experts' size, whether the top-k weights are
renormalised (Qwen3-MoE's ``norm_topk_prob``; Mixtral always) and in which dtype they are applied, and
how the checkpoint names the experts' tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.checkpoint_errors import CheckpointError
from pipeline.models.layers import WeightSlot
from pipeline.models.llama import MLP, LlamaFamilyForCausalLM
from pipeline.models.moe import MoeSpec, SparseMoeBlock, expert_checkpoint_names, expert_slot


def moe_spec(hf_config) -> MoeSpec:
    """The sparse MLP of a Qwen3-MoE or Mixtral config, exactly as transformers builds it."""
    if hf_config.model_type == "qwen3_moe":
        return MoeSpec(
            num_experts=hf_config.num_experts, top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.moe_intermediate_size, renormalize=bool(hf_config.norm_topk_prob),
            weights_in_fp32=False, block_name="mlp", projection_names=("gate_proj", "up_proj", "down_proj"),
        )
    if hf_config.model_type == "mixtral":
        return MoeSpec(
            num_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size, renormalize=True,
            weights_in_fp32=True, block_name="block_sparse_moe", projection_names=("w1", "w3", "w2"),
        )
    raise CheckpointError(f"model_type {hf_config.model_type!r} has no mixture-of-experts layout in Tandem")


def is_sparse_layer(hf_config, layer_index: int) -> bool:
    """Whether layer ``layer_index`` has the MoE MLP (else the dense one), transformers' rule per family."""
    if hf_config.model_type != "qwen3_moe":
        return True
    mlp_only_layers = getattr(hf_config, "mlp_only_layers", None) or []
    step = getattr(hf_config, "decoder_sparse_step", 1)
    return layer_index not in mlp_only_layers and hf_config.num_experts > 0 and (layer_index + 1) % step == 0


class LlamaMoeFamilyForCausalLM(LlamaFamilyForCausalLM):
    """Qwen3-MoE / Mixtral causal LM: ``LlamaFamilyForCausalLM`` whose sparse layers hold a ``SparseMoeBlock``.

    A sparse layer's parameters are ``model.layers.N.mlp.gate.weight`` (the router) and
    ``model.layers.N.mlp.experts.{gate_up_proj,down_proj}`` (all experts stacked).
    """

    def __init__(self, hf_config, dtype: torch.dtype, device):
        self.moe_spec = moe_spec(hf_config)  # before nn.Module's __init__ runs build_mlp; a frozen dataclass
        super().__init__(hf_config, dtype, device)

    def build_mlp(self, hf_config, layer_index: int, dtype: torch.dtype, device) -> nn.Module:
        if is_sparse_layer(hf_config, layer_index):
            return SparseMoeBlock(hf_config, self.moe_spec, dtype, device)
        return MLP(hf_config, dtype, device)

    def _slot_for(self, checkpoint_name: str) -> WeightSlot:
        return expert_slot(checkpoint_name, self.moe_spec) or super()._slot_for(checkpoint_name)

    def _checkpoint_names(self, param_name: str) -> list[str]:
        return expert_checkpoint_names(param_name, self.moe_spec) or super()._checkpoint_names(param_name)
