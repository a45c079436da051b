"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over flat batches and a paged latent cache.

Each token's keys and values are compressed into one latent row: ``kv_a_proj_with_mqa`` gives the
latent ``c`` (``kv_lora_rank``, then ``kv_a_layernorm``) and one rotary key part ``k_rope``
(``qk_rope_head_dim``, shared by every head). The cache holds ``[c, k_rope]`` per token, one "head" and
no separate V, so its bytes per token are ``kv_lora_rank + qk_rope_head_dim`` per layer instead of
``num_heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)``.

Attention runs in the absorbed form for prefill and decode alike: ``kv_b_proj``'s key rows are folded
into the query (``q_nope @ W_uk`` per head), every head attends over the latent rows themselves
(``kernels.mla_attention``), and ``kv_b_proj``'s value rows are applied to each head's weighted latent
afterwards. This is the expanded form's arithmetic regrouped (transformers expands ``kv_b_proj`` over
the whole context instead), so fp32 results agree to rounding. The softmax scale is
``qk_head_dim ** -0.5``, times ``mscale ** 2`` under yarn with ``mscale_all_dim`` as transformers does;
``rope_interleave`` rotates interleaved pairs, done here as a fixed permutation of q's and k's rope
columns followed by the rotate-half rope (the same products in the same order).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels import Kernels
from pipeline.forward_batch import ForwardBatch
from pipeline.models.layers import Linear, RMSNorm, rope_parameters

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not the config's
LATENT_NORM_EPS = 1e-6


def is_latent_attention(hf_config) -> bool:
    """Whether the config's attention is MLA (its KV cache holds one latent row per token)."""
    return getattr(hf_config, "kv_lora_rank", None) is not None


def latent_dim(hf_config) -> int:
    """Values per token and layer in the latent cache: ``kv_lora_rank + qk_rope_head_dim``."""
    return hf_config.kv_lora_rank + hf_config.qk_rope_head_dim


def softmax_scale(hf_config) -> float:
    """``qk_head_dim ** -0.5``, times yarn's ``mscale(factor, mscale_all_dim) ** 2`` where set (transformers' rule)."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(hf_config)
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if params["rope_type"] != "default" and mscale_all_dim and params["factor"] > 1:
        mscale = 0.1 * mscale_all_dim * math.log(params["factor"]) + 1.0
        scale = scale * mscale * mscale
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``[..., d]``: pairs ``(x0, x1), (x2, x3), ...`` laid out as ``[x0, x2, ..., x1, x3, ...]`` (rotate-half's)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    """MLA: q (through the q LoRA or ``q_proj``), the latent row into the cache, absorbed attention, o projection."""

    # kv_b_proj is never called: its key and value rows are folded into the queries and outputs (forward), so a
    # quantized checkpoint's kv_b_proj is loaded dequantized, not swapped for a quantized layer
    weights_read_directly = ("kv_b_proj",)

    def __init__(self, hf_config, dtype: torch.dtype, device):
        super().__init__()
        self.num_heads = hf_config.num_attention_heads
        self.kv_lora_rank = hf_config.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = hf_config.qk_nope_head_dim, hf_config.qk_rope_head_dim
        self.v_head_dim = hf_config.v_head_dim
        self.q_lora_rank = hf_config.q_lora_rank
        self.is_rope_interleaved = bool(getattr(hf_config, "rope_interleave", False))
        self.scale = softmax_scale(hf_config)
        hidden, has_bias = hf_config.hidden_size, bool(getattr(hf_config, "attention_bias", False))
        q_size = self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, [q_size], False, dtype, device)
        else:
            self.q_a_proj = Linear(hidden, [self.q_lora_rank], has_bias, dtype, device)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, dtype, device)
            self.q_b_proj = Linear(self.q_lora_rank, [q_size], False, dtype, device)
        self.kv_a_proj_with_mqa = Linear(hidden, [self.kv_lora_rank, self.qk_rope_head_dim], has_bias, dtype, device)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, dtype, device)
        # [num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]: per head, its key rows then its value rows
        self.kv_b_proj = Linear(self.kv_lora_rank, [self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)], False,
                                dtype, device)
        self.o_proj = Linear(self.num_heads * self.v_head_dim, [hidden], has_bias, dtype, device)
        # the two per-head products with kv_b_proj's rows, natively: the CPU set's in bf16
        # (kernels/cpu_mla_attention.AbsorbedProducts), else None and torch.bmm
        self.absorbed_products = None

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's key rows and value rows per head, ``[num_heads, qk_nope_head_dim | v_head_dim, kv_lora_rank]``"""
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w_kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        return w_uk, w_uv

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        batch: ForwardBatch,
        latent_cache: torch.Tensor,  # [num_blocks, page_size, 1, kv_lora_rank + qk_rope_head_dim]
        cos_sin_cache: torch.Tensor,  # [max_positions, qk_rope_head_dim]
        kernels: Kernels,
    ) -> torch.Tensor:  # [num_rows, hidden]: num_tokens but in a final layer's batch (ForwardBatch.query_rows)
        num_tokens = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden), kernels))
        q = q.view(num_tokens, self.num_heads, -1)  # [num_tokens, num_heads, qk_nope_head_dim + qk_rope_head_dim]
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split(self.kv_a_proj_with_mqa.shard_sizes, dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous(), kernels)  # [num_tokens, kv_lora_rank]
        k_rope = k_rope.reshape(num_tokens, 1, self.qk_rope_head_dim)  # [num_tokens, 1, qk_rope_head_dim]
        if self.is_rope_interleaved:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = kernels.apply_rotary(q_rope.contiguous(), k_rope.contiguous(), batch.positions, cos_sin_cache)
        kernels.store_latent(torch.cat((latent, k_rope.view(num_tokens, -1)), dim=-1), latent_cache, batch.slot_mapping)
        q_nope, q_rope = batch.kept_rows(q_nope), batch.kept_rows(q_rope)  # every row but in a final layer's batch
        num_rows = q_nope.shape[0]

        absorbed = self.absorbed_products
        q_latent = absorbed.queries(q_nope) if absorbed else None  # [num_rows, num_heads, kv_lora_rank]
        if q_latent is None:
            q_latent = torch.bmm(q_nope.transpose(0, 1), self.absorbed_weights()[0]).transpose(0, 1)
        query = torch.cat((q_latent, q_rope), dim=-1)  # [num_rows, num_heads, kv_lora_rank + qk_rope_head_dim]
        out_latent = kernels.mla_attention(
            query, latent_cache, batch.cu_seqlens_q, batch.context_lens, batch.block_tables, self.scale,
            self.kv_lora_rank,
        )  # [num_rows, num_heads, kv_lora_rank]
        out = absorbed.outputs(out_latent) if absorbed else None  # [num_rows, num_heads, v_head_dim]
        if out is None:
            out = torch.bmm(out_latent.transpose(0, 1), self.absorbed_weights()[1].transpose(1, 2)).transpose(0, 1)
        return self.o_proj(out.reshape(num_rows, self.num_heads * self.v_head_dim))
