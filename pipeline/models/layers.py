"""Building blocks of the models: uninitialised linear/norm weights and the RoPE cache.

Weights are allocated with ``torch.empty`` on the target device: every one of them is overwritten by
the checkpoint (a missing tensor is an error), so random initialisation would only waste load time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.norm_rope_ref import rope_cos_sin_cache
from pipeline.checkpoint_errors import CheckpointError

# rope types whose frequencies transformers recomputes from the running sequence length; a static
# cos/sin cache cannot follow them.
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


def empty_parameter(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


@dataclass(frozen=True)
class WeightSlot:
    """Where one checkpoint tensor lands: a parameter, one expert of a stacked one, one row block of a fused one."""

    param_name: str
    expert: int | None = None
    part: int | None = None


class Linear(nn.Module):
    """``y = x W^T (+ b)``. A fused projection lists its parts in ``shard_sizes`` (rows of W per part).

    ``gemm``, when a kernel set's ``prepare_model`` sets it (the CPU set: ``kernels.cpu_gemm.CpuLinear``),
    computes the product instead of ``F.linear``, from its own (packed) copy of the weights.
    """

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool, dtype: torch.dtype, device):
        super().__init__()
        self.shard_sizes = list(shard_sizes)
        out_features = sum(self.shard_sizes)
        self.weight = empty_parameter(out_features, in_features, dtype=dtype, device=device)  # [out, in]
        self.bias = empty_parameter(out_features, dtype=dtype, device=device) if bias else None
        self.gemm = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        if self.gemm is not None:
            return self.gemm(x)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Holds the weight and eps; the arithmetic is the kernel's (fused with the residual add when given)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter(size, dtype=dtype, device=device)  # [size]

    def forward(self, x: torch.Tensor, kernels, residual: torch.Tensor | None = None):
        return kernels.rms_norm(x, self.weight, self.eps, residual)

    def add_and_norm(self, x: torch.Tensor, kernels, residual: torch.Tensor | None):
        """A decoder layer's input norm: (normed, running sum), where ``x`` is the previous layer's delta
        and ``residual`` the running sum so far (None before the first layer: the sum is ``x`` itself)."""
        if residual is None:
            return self(x, kernels), x
        return self(x, kernels, residual)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from one, applied in fp32 (``kernels.offset_rms_norm``)."""

    def forward(self, x: torch.Tensor, kernels, residual: torch.Tensor | None = None):
        return kernels.offset_rms_norm(x, self.weight, self.eps, residual)


class Embedding(nn.Module):
    """Token embeddings, times ``scale`` when given (Gemma: sqrt(hidden_size), rounded to the model dtype first)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device, scale: float | None = None):
        super().__init__()
        self.weight = empty_parameter(num_embeddings, embedding_dim, dtype=dtype, device=device)  # [vocab, hidden]
        # rounded through fp32 to the model dtype exactly as transformers rounds it (bf16: sqrt(3072) -> 55.5)
        scale_tensor = None if scale is None else torch.tensor(scale, dtype=torch.float32).to(dtype=dtype, device=device)
        self.register_buffer("scale", scale_tensor, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        embedded = F.embedding(input_ids, self.weight)
        return embedded if self.scale is None else embedded * self.scale


def has_rope_per_layer_type(hf_config) -> bool:
    """Whether the config sets RoPE per kind of layer (Gemma 3: ``{"sliding_attention": {...}, "full_attention": {...}}``)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return any(isinstance(value, dict) for value in params.values())


def rope_parameters(hf_config, layer_type: str = "full_attention") -> dict:
    """The config's RoPE settings as one dict with ``rope_type`` and ``rope_theta`` (transformers 5 and 4 layouts),
    those of ``layer_type``'s layers where the config sets them per kind of layer."""
    if has_rope_per_layer_type(hf_config):  # transformers fills in each kind's rope_theta
        return {"rope_type": "default", **hf_config.rope_parameters[layer_type]}
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def build_rope_cache(hf_config, head_dim: int, device, layer_type: str = "full_attention") -> torch.Tensor:
    """cos/sin cache ``[max_position_embeddings, head_dim]`` (fp32), frequencies exactly as transformers computes them
    (for ``layer_type``'s layers where the config sets RoPE per kind of layer)."""
    params = rope_parameters(hf_config, layer_type)
    rope_type = params["rope_type"]
    if rope_type in _DYNAMIC_ROPE_TYPES:
        raise CheckpointError(f"rope_type {rope_type!r} is not supported (its frequencies depend on the sequence length)")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError("partial_rotary_factor != 1 is not supported: rotary embedding covers the whole head")
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))  # [head_dim / 2]
        attention_scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # only for scaled rope types

        if rope_type not in ROPE_INIT_FUNCTIONS:
                raise CheckpointError(f"unknown rope_type {rope_type!r} in the model config")
        extra = {"layer_type": layer_type} if has_rope_per_layer_type(hf_config) else {}
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **extra)
    if inv_freq.numel() * 2 != head_dim:
        raise CheckpointError(f"rotary dim {inv_freq.numel() * 2} != head_dim {head_dim} is not supported")
    cache = rope_cos_sin_cache(inv_freq, hf_config.max_position_embeddings, attention_scaling)
    return cache.to(device)  # [max_positions, head_dim]
