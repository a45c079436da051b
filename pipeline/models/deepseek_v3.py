"""DeepSeek-V3 (``DeepseekV3ForCausalLM``) over flat batches and a paged latent KV cache.

Built from the Llama family's parts (``llama.py``: norms, the dense gated MLP, embeddings, logits and
checkpoint loading) with DeepSeek's two kinds of layer part, each as transformers' modeling file has it:

- attention is multi-head latent attention (``mla.py``): the cache holds one latent row per token and
  layer (``[num_layers, 1, num_blocks, page_size, 1, kv_lora_rank + qk_rope_head_dim]``, see
  ``model_runner.kv_cache_shape``), decode and prefill both in the absorbed form;
- the first ``first_k_dense_replace`` layers have the dense MLP, every later one DeepSeek's MoE
  (``deepseek_moe.py``: grouped sigmoid routing with a correction bias, routed and shared experts).

RoPE covers only ``qk_rope_head_dim`` (the config's ``head_dim``), default or yarn-scaled. The
multi-token-prediction layer some checkpoints ship (``model.layers.<num_hidden_layers>``) is skipped,
as transformers skips it.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from kernels import Kernels
from pipeline.forward_batch import ForwardBatch
from pipeline.models.deepseek_moe import DeepseekMoe, deepseek_moe_spec
from pipeline.models.layers import Embedding, RMSNorm, WeightSlot
from pipeline.models.llama import MLP, LlamaFamilyForCausalLM
from pipeline.models.mla import LatentAttention, latent_dim
from pipeline.models.moe import expert_checkpoint_names, expert_slot

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV3DecoderLayer(nn.Module):
    """Pre-norm latent attention, then the dense MLP or the MoE (by ``first_k_dense_replace``)."""

    def __init__(self, hf_config, mlp: nn.Module, dtype: torch.dtype, device):
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype, device)
        self.self_attn = LatentAttention(hf_config, dtype, device)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype, device)
        self.mlp = mlp

    def forward(self, hidden, residual, batch, latent_cache, cos_sin_cache, kernels):
        hidden, residual = self.input_layernorm.add_and_norm(hidden, kernels, residual)
        hidden = self.self_attn(hidden, batch, latent_cache, cos_sin_cache, kernels)
        hidden, residual = self.post_attention_layernorm(hidden, kernels, batch.kept_rows(residual))
        return self.mlp(hidden, kernels), residual


class DeepseekV3Model(nn.Module):
    """Embeddings, DeepSeek's decoder layers and the final norm (``LlamaModel``'s names)."""

    def __init__(self, hf_config, mlps: list[nn.Module], dtype: torch.dtype, device):
        super().__init__()
        self.embed_tokens = Embedding(hf_config.vocab_size, hf_config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(hf_config, mlp, dtype, device) for mlp in mlps)
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype, device)


class DeepseekV3ForCausalLM(LlamaFamilyForCausalLM):
    """DeepSeek-V3 causal LM: ``LlamaFamilyForCausalLM``'s loading and logits around MLA layers and DeepSeek's MoE.

    Parameter names follow the checkpoint's, with the dense MLPs' gate/up fused and the routed experts
    stacked (``model.layers.N.mlp.experts.{gate_up_proj,down_proj}``, either checkpoint layout).
    """

    def __init__(self, hf_config, dtype: torch.dtype, device):
        self.moe_spec = deepseek_moe_spec(hf_config)  # before nn.Module's __init__ runs build_mlp
        super().__init__(hf_config, dtype, device)
        self.num_kv_heads, self.head_dim = 1, latent_dim(hf_config)  # the cache's geometry: one latent row

    def build_model(self, hf_config, dtype: torch.dtype, device) -> nn.Module:
        mlps = [self.build_mlp(hf_config, index, dtype, device) for index in range(self.num_layers)]
        return DeepseekV3Model(hf_config, mlps, dtype, device)

    def build_mlp(self, hf_config, layer_index: int, dtype: torch.dtype, device) -> nn.Module:
        if layer_index >= hf_config.first_k_dense_replace:
            return DeepseekMoe(hf_config, dtype, device)
        return MLP(hf_config, dtype, device)

    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        """``kv_cache``: ``[num_layers, 1, num_blocks, page_size, 1, kv_lora_rank + qk_rope_head_dim]``."""
        hidden = self.model.embed_tokens(batch.input_ids)  # [num_tokens, hidden]
        residual = None
        for index, layer in enumerate(self.model.layers):
            hidden, residual = layer(hidden, residual, batch.of_layer(index, self.num_layers), kv_cache[index, 0],
                                     self.cos_sin_cache, kernels)
        hidden, _ = self.model.norm(hidden, kernels, residual)
        return hidden

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        def main_layers_only():
            for name, tensor in named_tensors:
                match = _LAYER_INDEX.match(name)
                if match is None or int(match[1]) < self.num_layers:  # skip the multi-token-prediction layer
                    yield name, tensor

        super().load_weights(main_layers_only())

    def _slot_for(self, checkpoint_name: str) -> WeightSlot:
        if checkpoint_name.endswith(".self_attn.q_proj.weight"):  # MLA's own q projection, fused with nothing
            return WeightSlot(checkpoint_name)
        return expert_slot(checkpoint_name, self.moe_spec) or super()._slot_for(checkpoint_name)

    def _checkpoint_names(self, param_name: str) -> list[str]:
        return expert_checkpoint_names(param_name, self.moe_spec) or super()._checkpoint_names(param_name)
