"""One compact causal LM for the Llama family: Llama, Mistral, Qwen2 and Qwen3 checkpoints.

The architectures differ only in small switches (read from the transformers config): biases on the
attention projections, RMSNorm of q and k per head (Qwen3), an explicit ``head_dim``, tied
embeddings, scaled RoPE, a sliding attention window on some layers. The decoder layer takes its MLP
as a part (``build_mlp``), so the mixture-of-experts families (``llama_moe.py``) reuse all the rest. Numerics follow transformers
step by step, so fp32 on CPU is token-exact with it. Every hot-path op goes through the ``Kernels``
object passed to ``forward``, so the torch and triton backends are interchangeable.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
import torch.nn.functional as F

from kernels import Kernels
from pipeline.forward_batch import ForwardBatch
from pipeline.models.layers import Embedding, Linear, RMSNorm, WeightSlot, build_rope_cache, empty_parameter
from pipeline.checkpoint_errors import CheckpointError

# Projections fused into one matmul, and the checkpoint tensors they are concatenated from (in row order).
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_PART_OF: dict[str, tuple[str, int]] = {
    part: (fused, index) for fused, parts in FUSED_PROJECTIONS.items() for index, part in enumerate(parts)
}


def _head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


# The config keys each family's transformers modeling code reads. A key in a config whose family ignores it (a Llama
# config with "sliding_window", a Mistral one with "attention_bias") changes nothing there, so nothing here either.
_READS_SLIDING_WINDOW = frozenset({"mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma3", "gemma3_text",
                                   "gpt_oss"})
_READS_ATTENTION_BIAS = frozenset({"llama", "qwen3", "qwen3_moe", "gemma3", "gemma3_text", "gpt_oss"})
_READS_MLP_BIAS = frozenset({"llama"})


def config_flag(hf_config, key: str, readers: frozenset[str]) -> bool:
    """``hf_config``'s boolean ``key`` where its family reads it, else False."""
    return hf_config.model_type in readers and bool(getattr(hf_config, key, False))


def _sliding_windows(hf_config) -> list[int | None]:
    """The attention window of each layer, exactly where transformers applies one (None = full causal)."""
    window = getattr(hf_config, "sliding_window", None)
    num_layers = hf_config.num_hidden_layers
    if window is None or hf_config.model_type not in _READS_SLIDING_WINDOW:
        return [None] * num_layers
    if hf_config.model_type in ("qwen2", "qwen3", "gpt_oss"):
        # Qwen and gpt-oss window only the layers their config marks "sliding_attention" (Qwen: use_sliding_window
        # and index >= max_window_layers when layer_types is not spelled out).
        layer_types = getattr(hf_config, "layer_types", None)
        if layer_types is None:
            is_used = getattr(hf_config, "use_sliding_window", False)
            first = getattr(hf_config, "max_window_layers", 0)
            return [window if is_used and i >= first else None for i in range(num_layers)]
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    return [window] * num_layers  # Mistral windows every layer


class Attention(nn.Module):
    """q/k/v projections, optional per-head q/k norms, rotary, the paged KV cache and attention, o projection.

    ``scale`` defaults to ``head_dim ** -0.5``; ``qk_norm`` is the norm class of the per-head q/k norms
    (Qwen3: ``RMSNorm`` by default; Gemma passes its own). gpt-oss adds ``sinks``, one learned logit per
    query head in the softmax's denominator (``kernels.paged_attention``'s ``sinks``).
    """

    def __init__(self, hf_config, sliding_window: int | None, dtype: torch.dtype, device,
                 scale: float | None = None, qk_norm: type[RMSNorm] | None = None):
        super().__init__()
        self.num_q_heads = hf_config.num_attention_heads
        self.num_kv_heads = hf_config.num_key_value_heads or self.num_q_heads
        self.head_dim = _head_dim(hf_config)
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        has_bias = config_flag(hf_config, "attention_bias", _READS_ATTENTION_BIAS)
        is_qwen2 = hf_config.model_type == "qwen2"  # Qwen2 always biases q/k/v and never o
        hidden, q_size, kv_size = hf_config.hidden_size, self.num_q_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(hidden, [q_size, kv_size, kv_size], has_bias or is_qwen2, dtype, device)
        self.o_proj = Linear(q_size, [hidden], has_bias and not is_qwen2, dtype, device)
        self.has_qk_norm = qk_norm is not None or hf_config.model_type in ("qwen3", "qwen3_moe")
        if self.has_qk_norm:
            norm = qk_norm or RMSNorm
            self.q_norm = norm(self.head_dim, hf_config.rms_norm_eps, dtype, device)
            self.k_norm = norm(self.head_dim, hf_config.rms_norm_eps, dtype, device)
        is_gpt_oss = hf_config.model_type == "gpt_oss"
        self.sinks = empty_parameter(self.num_q_heads, dtype=dtype, device=device) if is_gpt_oss else None

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        batch: ForwardBatch,
        k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
        cos_sin_cache: torch.Tensor,  # [max_positions, head_dim]
        kernels: Kernels,
    ) -> torch.Tensor:  # [num_query_rows, hidden] (num_tokens but in a final layer's batch)
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim]
        q, k, v = qkv.split(self.qkv_proj.shard_sizes, dim=-1)
        q = q.reshape(num_tokens, self.num_q_heads, self.head_dim)  # [num_tokens, num_q_heads, head_dim]
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        if self.has_qk_norm:  # per-head RMSNorm before rope, as Qwen3 and Gemma 3 do
            q = self.q_norm(q.reshape(-1, self.head_dim), kernels).view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim), kernels).view_as(k)
        q, k = kernels.apply_rotary(q, k, batch.positions, cos_sin_cache)
        kernels.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        q = batch.kept_rows(q)  # [num_query_rows, num_q_heads, head_dim]: every row but in a final layer's batch
        out = kernels.paged_attention(
            q, k_cache, v_cache, batch.cu_seqlens_q, batch.context_lens, batch.block_tables,
            self.scale, self.sliding_window, sinks=self.sinks,
        )  # [num_query_rows, num_q_heads, head_dim]
        return self.o_proj(out.reshape(q.shape[0], self.num_q_heads * self.head_dim))


# The gated MLP's activations transformers names in a config's hidden_act / hidden_activation, and the
# kernel that computes act(gate) * up for each.
GATED_ACTIVATIONS: dict[str, str] = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul"}


def gated_activation_kernel(hf_config) -> str:
    """The ``Kernels`` field computing act(gate) * up for the config's activation; ``CheckpointError`` if none does."""
    name = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None) or "silu"
    if name not in GATED_ACTIVATIONS:
        raise CheckpointError(f"hidden activation {name!r} is not supported (supported: {', '.join(GATED_ACTIVATIONS)})")
    return GATED_ACTIVATIONS[name]


class MLP(nn.Module):
    """Gated dense MLP: ``down(act(gate(x)) * up(x))``, gate and up fused into one projection.

    ``intermediate_size`` defaults to the config's (DeepSeek's shared experts pass their own)."""

    def __init__(self, hf_config, dtype: torch.dtype, device, intermediate_size: int | None = None):
        super().__init__()
        self.activation = gated_activation_kernel(hf_config)
        hidden, intermediate = hf_config.hidden_size, intermediate_size or hf_config.intermediate_size
        has_bias = config_flag(hf_config, "mlp_bias", _READS_MLP_BIAS)
        self.gate_up_proj = Linear(hidden, [intermediate, intermediate], has_bias, dtype, device)
        self.down_proj = Linear(intermediate, [hidden], has_bias, dtype, device)

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:  # [num_tokens, hidden]
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        return self.down_proj(getattr(kernels, self.activation)(gate_up))  # act(gate) * up: [num_tokens, intermediate]


class DecoderLayer(nn.Module):
    """Pre-norm attention, then an MLP of any kind: dense ``MLP`` or ``moe.SparseMoeBlock`` (``mlp(x, kernels)``)."""

    def __init__(self, hf_config, sliding_window: int | None, mlp: nn.Module, dtype: torch.dtype, device):
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype, device)
        self.self_attn = Attention(hf_config, sliding_window, dtype, device)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype, device)
        self.mlp = mlp

    def forward(self, hidden, residual, batch, k_cache, v_cache, cos_sin_cache, kernels):
        hidden, residual = self.input_layernorm.add_and_norm(hidden, kernels, residual)
        hidden = self.self_attn(hidden, batch, k_cache, v_cache, cos_sin_cache, kernels)
        hidden, residual = self.post_attention_layernorm(hidden, kernels, batch.kept_rows(residual))
        return self.mlp(hidden, kernels), residual


class LlamaModel(nn.Module):
    def __init__(self, hf_config, mlps: list[nn.Module], dtype: torch.dtype, device):
        super().__init__()
        self.embed_tokens = Embedding(hf_config.vocab_size, hf_config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(hf_config, window, mlp, dtype, device) for window, mlp in zip(_sliding_windows(hf_config), mlps)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype, device)


def is_hooked(layer: nn.Module) -> bool:
    """Whether anything is hooked on the layer or its modules (tensor parallelism's all-reduces): a kernel set that
    runs the layer's work in one call would skip them."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in layer.modules())


class LlamaFamilyForCausalLM(nn.Module):
    """Llama/Mistral/Qwen2/Qwen3 causal LM over a flat batch and a paged KV cache.

    Parameter names follow the checkpoint's (``model.layers.N.self_attn...``), except that q/k/v and
    gate/up are stored fused as ``qkv_proj`` and ``gate_up_proj``.
    """

    def __init__(self, hf_config, dtype: torch.dtype, device):
        super().__init__()
        self.hf_config = hf_config
        self.dtype = dtype
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads = hf_config.num_key_value_heads or hf_config.num_attention_heads
        self.head_dim = _head_dim(hf_config)
        self.vocab_size = hf_config.vocab_size
        self.is_tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = self.build_model(hf_config, dtype, device)
        self.lm_head = None if self.is_tied else Linear(hf_config.hidden_size, [hf_config.vocab_size], False, dtype, device)
        # fp32 whatever the model dtype: rotary casts it to the activations' dtype as transformers does
        self.register_buffer("cos_sin_cache", build_rope_cache(hf_config, self.head_dim, device), persistent=False)
        # tanh softcapping of the logits, where the config sets it (Gemma)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)
        self.logits_gemm = None  # the output projection's GEMM when a kernel set prepared one (see Linear.gemm)
        # the decoder layers' step as one call, where a kernel set's prepare_model made one (the CPU set's:
        # kernels/cpu_decoder_stack.py, over plain_decoder_layers); it says which batches it takes
        self.native_decoder_stack = None

    def build_model(self, hf_config, dtype: torch.dtype, device) -> nn.Module:
        """The decoder (``model.``: embeddings, layers, final norm); other families with these weights' names override it."""
        mlps = [self.build_mlp(hf_config, index, dtype, device) for index in range(self.num_layers)]
        return LlamaModel(hf_config, mlps, dtype, device)

    def build_mlp(self, hf_config, layer_index: int, dtype: torch.dtype, device) -> nn.Module:
        """Layer ``layer_index``'s MLP: the dense kind here; the mixture-of-experts families override it."""
        return MLP(hf_config, dtype, device)

    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        """Run every token of ``batch``, writing its K/V into ``kv_cache``; returns ``[num_tokens, hidden]`` after the
        final norm (only the final layer's rows, ``[rows, hidden]``, where the batch has a ``final_layer``).

        ``kv_cache``: ``[num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim]``.
        """
        hidden = self.model.embed_tokens(batch.input_ids)  # [num_tokens, hidden]
        stack = self.native_decoder_stack
        if stack is not None and stack.takes(batch):
            hidden, residual = stack(hidden, batch, kv_cache)
        else:
            residual = None
            for index, layer in enumerate(self.model.layers):
                hidden, residual = layer(hidden, residual, batch.of_layer(index, self.num_layers), kv_cache[index, 0],
                                         kv_cache[index, 1], self.cos_sin_cache_of(index), kernels)
        hidden, _ = self.model.norm(hidden, kernels, residual)
        return hidden

    # the kind of layer plain_decoder_layers returns: "llama" here, "gemma3" for Gemma 3's (kernels/cpu_decoder_stack)
    decoder_layer_form = "llama"

    def plain_decoder_layers(self) -> list[DecoderLayer] | None:
        """Every decoder layer, where each is exactly Llama's (``RMSNorm``s, ``Attention`` without sinks and with
        Qwen3's ``RMSNorm`` q/k norms or none, the dense ``MLP`` with SiLU, nothing hooked on them, such as tensor
        parallelism's all-reduces): what a kernel set may run in one call; None where any layer is another kind."""
        layers = list(self.model.layers)
        for layer in layers:
            attention, mlp = layer.self_attn, layer.mlp
            is_plain = (type(layer) is DecoderLayer and type(attention) is Attention and type(mlp) is MLP
                        and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
                        and attention.sinks is None and (not attention.has_qk_norm or (
                            type(attention.q_norm) is RMSNorm and type(attention.k_norm) is RMSNorm))
                        and mlp.activation == "silu_and_mul" and not is_hooked(layer))
            if not is_plain:
                return None
        return layers

    def cos_sin_cache_of(self, layer_index: int) -> torch.Tensor:
        """``[max_positions, head_dim]``: the RoPE cos/sin cache layer ``layer_index`` rotates with (one for all here)."""
        return self.cos_sin_cache

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> fp32 logits ``[n, vocab]`` (the matmul and any softcapping run in the model dtype, like transformers)."""
        if self.logits_gemm is not None:
            logits = self.logits_gemm(hidden)
        else:
            logits = F.linear(hidden, self.output_weight())
        if self.final_logit_softcapping is not None:
            logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return logits.float()

    def output_weight(self) -> torch.Tensor:
        """``[vocab, hidden]``: the output projection's weight (the embedding's when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the parameters, casting to the model dtype and device.

        Raises ``CheckpointError`` on a shape mismatch, an unexpected tensor, or a missing one.
        """
        params = dict(self.named_parameters())
        expected = {name for param_name in params for name in self._checkpoint_names(param_name)}
        loaded: set[str] = set()
        for name, tensor in named_tensors:
            if ".rotary_emb." in name or (self.is_tied and name == "lm_head.weight"):
                continue  # derived from the config / the embedding: the checkpoint copy adds nothing
            slot = self._slot_for(name)
            target = params[slot.param_name].data if slot.param_name in params else None
            if target is not None and slot.expert is not None:
                target = target[slot.expert] if slot.expert < target.shape[0] else None
            if target is None:
                raise CheckpointError(f"unexpected tensor {name} in the checkpoint: this model config has no such weight")
            if slot.part is not None:
                sizes = self._module_of(slot.param_name).shard_sizes
                target = target.narrow(0, sum(sizes[:slot.part]), sizes[slot.part])
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"tensor {name} has shape {tuple(tensor.shape)} in the checkpoint; the model expects {tuple(target.shape)}"
                )
            target.copy_(tensor)
            is_whole = slot.expert is None and slot.part is None  # e.g. all experts stacked in one tensor
            loaded.update(self._checkpoint_names(slot.param_name) if is_whole else [name])
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
            raise CheckpointError(f"the checkpoint is missing tensor(s): {shown}")

    def _slot_for(self, checkpoint_name: str) -> WeightSlot:
        """Where a checkpoint tensor goes: its parameter, and the row block of a fused projection."""
        parts = checkpoint_name.split(".")
        if len(parts) >= 2 and parts[-2] in _PART_OF:
            fused, index = _PART_OF[parts[-2]]
            return WeightSlot(".".join(parts[:-2] + [fused, parts[-1]]), part=index)
        return WeightSlot(checkpoint_name)

    def _module_of(self, param_name: str) -> nn.Module:
        return self.get_submodule(param_name.rsplit(".", 1)[0])

    def _checkpoint_names(self, param_name: str) -> list[str]:
        """The checkpoint tensors that fill parameter ``param_name`` (the parts of a fused projection)."""
        *prefix, module, leaf = param_name.split(".")
        return [".".join([*prefix, part, leaf]) for part in FUSED_PROJECTIONS.get(module, (module,))]
