"""Multi-head latent attention (MLA, DeepSeek-V2/V3) on the CPU: the native paged-attention kernel over the latent rows.

In the absorbed form MLA is multi-query attention whose keys are the cached rows (the latent, then the rotary key
part) and whose values are their latent part (``kernels/mla_attention_ref.py``). The native kernel takes it as
attention with one KV head as wide as the row, K and V the same rows read in place; the value pass also sums the
rotary columns, which are dropped (64 of DeepSeek's 576). Query heads go to the kernel in groups of at most
``NATIVE_MAX_GROUP`` (DeepSeek-V3's 128 heads in two calls), each group a view of the query, since every head
attends to the one latent "head". Prompt chunks stay on the native kernel on an AMX CPU too: the load-time
measurement that sends bf16 chunks to torch's flash attention there (``kernels/cpu_prompt_route.py``) is made for
layers with K/V per head, not for latent rows. Where the kernel does not apply (no native module, fp16, a row wider
than ``NATIVE_MAX_HEAD_DIM``) the reference runs.
"""

from __future__ import annotations

import torch

from kernels.cpu_paged_attention import NATIVE_MAX_GROUP, native_applies, paged_attention_native
from kernels.mla_attention_ref import mla_attention_ref


def mla_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank + qk_rope_head_dim], absorbed
    latent_cache: torch.Tensor,  # [num_blocks, page_size, 1, kv_lora_rank + qk_rope_head_dim]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:  # [num_tokens, num_heads, kv_lora_rank]
    """``mla_attention_ref``'s contract."""
    num_heads = query.shape[1]
    group = min(num_heads, NATIVE_MAX_GROUP)
    if (query.shape[-1] != latent_cache.shape[-1] or latent_cache.shape[2] != 1
            or not native_applies(query[:, :group], latent_cache, latent_cache)):
        return mla_attention_ref(query, latent_cache, cu_seqlens_q, context_lens, block_tables, scale, kv_lora_rank)
    parts = [paged_attention_native(query[:, first:first + group], latent_cache, latent_cache, cu_seqlens_q,
                                    context_lens, block_tables, scale) for first in range(0, num_heads, group)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return out[..., :kv_lora_rank]
