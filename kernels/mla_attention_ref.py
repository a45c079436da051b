"""Torch references for multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache.

An MLA layer caches one row per token: the compressed latent ``c`` (``kv_lora_rank`` values, after its
norm) followed by the rotated shared key part ``k_rope`` (``qk_rope_head_dim`` values), one "head" with
no separate V. In the absorbed form every query head attends over these rows directly: its query is
``[q_nope @ W_uk, q_rope]`` (the key up-projection folded into the query), its score with token t is
``q . row_t``, and its output is the softmax-weighted sum of the latents ``c_t`` (the value
up-projection is applied afterwards). That is multi-query attention whose keys are the whole row and
whose values are its first ``kv_lora_rank`` columns, which is how the reference computes it.
This is the CPU path and the oracle the triton kernel (``kernels/triton_mla_attention.py``) is tested against.
"""

from __future__ import annotations

import torch

from kernels.paged_attention_ref import paged_attention_ref


def store_latent_ref(
    latent: torch.Tensor,  # [num_tokens, kv_lora_rank + qk_rope_head_dim]
    latent_cache: torch.Tensor,  # [num_blocks, page_size, 1, kv_lora_rank + qk_rope_head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * page_size + offset; -1 = skip
) -> None:
    keep = slot_mapping >= 0
    latent_cache.view(-1, latent_cache.shape[-1])[slot_mapping[keep]] = latent[keep].to(latent_cache.dtype)


def mla_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank + qk_rope_head_dim], absorbed
    latent_cache: torch.Tensor,  # [num_blocks, page_size, 1, kv_lora_rank + qk_rope_head_dim]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32, query token offsets into the flat batch
    context_lens: torch.Tensor,  # [num_seqs] int32, cached length of each sequence after this step
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:  # [num_tokens, num_heads, kv_lora_rank]: each head's softmax-weighted latent
    """Causal attention of a flat batch (prefill chunks over cached prefixes and decodes alike) over the
    latent rows: the value is the row's latent part, so the rope columns of the output are dropped."""
    if query.shape[-1] != latent_cache.shape[-1] or latent_cache.shape[2] != 1:
        raise ValueError(f"mla_attention: query {tuple(query.shape)} does not fit latent cache "
                         f"{tuple(latent_cache.shape)}")
    out = paged_attention_ref(query, latent_cache, latent_cache, cu_seqlens_q, context_lens, block_tables, scale)
    return out[..., :kv_lora_rank]
