"""Gemma 3, text only (``Gemma3ForCausalLM``), over flat batches and the paged KV cache.

Built from the Llama family's parts (``llama.py``: attention, the gated MLP, checkpoint loading and the
logits) with Gemma's switches, each as transformers' modeling file has it:

- local and global layers by ``layer_types`` (from ``sliding_window_pattern`` when not spelled out): local
  layers attend within ``sliding_window`` and rotate with ``rope_local_base_freq``, global ones attend to
  the whole context and rotate with ``rope_theta`` and ``rope_scaling``: two RoPE caches;
- every norm is Gemma's RMSNorm (weight stored as an offset from one, applied in fp32), also on q and k
  per head; each layer norms its attention and MLP outputs before the residual add as well as their inputs;
- the attention scale is ``query_pre_attn_scalar ** -0.5``; the MLP is GELU-tanh gated (``hidden_activation``);
- the embeddings are scaled by sqrt(hidden_size) rounded to the model dtype, the logits softcapped by
  ``final_logit_softcapping`` when set, and the output projection is tied to the embeddings by default.

transformers 5 does not apply ``attn_logit_softcapping`` in Gemma 3's attention (the config field is
read, never passed to the attention function), so neither does Tandem: the oracle is transformers.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.checkpoint_errors import CheckpointError
from pipeline.models.layers import Embedding, OffsetRMSNorm, build_rope_cache
from pipeline.models.llama import MLP, Attention, LlamaFamilyForCausalLM, is_hooked

LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_types(hf_config) -> list[str]:
    """Each layer's kind, local ("sliding_attention") or global ("full_attention"), as transformers reads the config."""
    kinds = list(hf_config.layer_types)  # the config fills it from sliding_window_pattern when absent
    if len(kinds) != hf_config.num_hidden_layers or not set(kinds) <= set(LAYER_TYPES):
        raise CheckpointError(f"layer_types must name one of {', '.join(LAYER_TYPES)} per layer (got {kinds})")
    return kinds


class Gemma3DecoderLayer(nn.Module):
    """Attention and the MLP, each between an input norm and an output norm, then the residual add."""

    def __init__(self, hf_config, layer_type: str, dtype: torch.dtype, device):
        super().__init__()
        self.is_local = layer_type == "sliding_attention"
        window = hf_config.sliding_window if self.is_local else None
        eps, hidden = hf_config.rms_norm_eps, hf_config.hidden_size
        self.input_layernorm = OffsetRMSNorm(hidden, eps, dtype, device)
        self.self_attn = Attention(hf_config, window, dtype, device, scale=hf_config.query_pre_attn_scalar**-0.5,
                                   qk_norm=OffsetRMSNorm)
        self.post_attention_layernorm = OffsetRMSNorm(hidden, eps, dtype, device)
        self.pre_feedforward_layernorm = OffsetRMSNorm(hidden, eps, dtype, device)
        self.mlp = MLP(hf_config, dtype, device)
        self.post_feedforward_layernorm = OffsetRMSNorm(hidden, eps, dtype, device)

    def forward(self, hidden, residual, batch, k_cache, v_cache, cos_sin_cache, kernels):
        hidden, residual = self.input_layernorm.add_and_norm(hidden, kernels, residual)
        hidden = self.self_attn(hidden, batch, k_cache, v_cache, cos_sin_cache, kernels)
        hidden = self.post_attention_layernorm(hidden, kernels)
        hidden, residual = self.pre_feedforward_layernorm(hidden, kernels, batch.kept_rows(residual))
        hidden = self.post_feedforward_layernorm(self.mlp(hidden, kernels), kernels)
        return hidden, residual


class Gemma3Model(nn.Module):
    def __init__(self, hf_config, dtype: torch.dtype, device):
        super().__init__()
        hidden = hf_config.hidden_size
        self.embed_tokens = Embedding(hf_config.vocab_size, hidden, dtype, device, scale=hidden**0.5)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(hf_config, kind, dtype, device) for kind in layer_types(hf_config)
        )
        self.norm = OffsetRMSNorm(hidden, hf_config.rms_norm_eps, dtype, device)


class Gemma3ForCausalLM(LlamaFamilyForCausalLM):
    """Gemma 3 text causal LM: ``LlamaFamilyForCausalLM`` with Gemma's decoder and a second RoPE cache for local layers.

    Parameter names follow the checkpoint's, q/k/v and gate/up fused as in the Llama family.
    """

    decoder_layer_form = "gemma3"  # what plain_decoder_layers returns (kernels/cpu_decoder_stack.py)

    def __init__(self, hf_config, dtype: torch.dtype, device):
        if hf_config.model_type != "gemma3_text":
            raise CheckpointError(f"Gemma3ForCausalLM needs a text-only gemma3_text config (got {hf_config.model_type!r})")
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise CheckpointError("use_bidirectional_attention is not supported: Tandem serves causal attention only")
        super().__init__(hf_config, dtype, device)
        self.register_buffer(
            "local_cos_sin_cache", build_rope_cache(hf_config, self.head_dim, device, "sliding_attention"), persistent=False
        )  # [max_positions, head_dim], fp32 like cos_sin_cache (the global layers')

    def build_model(self, hf_config, dtype: torch.dtype, device) -> nn.Module:
        return Gemma3Model(hf_config, dtype, device)

    def cos_sin_cache_of(self, layer_index: int) -> torch.Tensor:
        return self.local_cos_sin_cache if self.model.layers[layer_index].is_local else self.cos_sin_cache

    def plain_decoder_layers(self) -> list[Gemma3DecoderLayer] | None:
        """Every decoder layer, where each is exactly Gemma 3's (offset norms around attention and the MLP and on q and
        k, attention without sinks, the GELU-tanh gated MLP, nothing hooked on them); None otherwise."""
        layers = list(self.model.layers)
        for layer in layers:
            attention, mlp = layer.self_attn, layer.mlp
            is_plain = (type(layer) is Gemma3DecoderLayer and type(attention) is Attention and type(mlp) is MLP
                        and attention.sinks is None and attention.has_qk_norm
                        and all(type(norm) is OffsetRMSNorm for norm in (
                            layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                            layer.post_feedforward_layernorm, attention.q_norm, attention.k_norm))
                        and mlp.activation == "gelu_tanh_and_mul" and not is_hooked(layer))
            if not is_plain:
                return None
        return layers
