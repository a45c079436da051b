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

``AbsorbedProducts``: the absorbed form's two per-head products with ``kv_b_proj``'s rows (each head's query times
its key rows, each head's weighted latent times its value rows) on the native grouped GEMM in bf16, each head an
"expert" that takes every row. ``torch.bmm`` ran them in bf16 at 2-3 GB/s of weights on Zen 4 (0.8 ms a product
for DeepSeek-V2-Lite's 16 heads at batch 1, a sixth of its decode step).
"""

from __future__ import annotations

import torch

from kernels import cpu_moe
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


class AbsorbedProducts:
    """An MLA layer's per-head products in bf16 on the native grouped GEMM: ``queries`` (``[rows, heads, nope]`` ->
    ``[rows, heads, kv_lora_rank]``, times each head's key rows) and ``outputs`` (``[rows, heads, kv_lora_rank]`` ->
    ``[rows, heads, v_head_dim]``, times its value rows). Each returns None where the caller's ``torch.bmm`` should
    run instead: another dtype, or more rows than an AMX CPU's grouped GEMM takes (``cpu_moe.MAX_ROWS_PER_EXPERT``:
    oneDNN's AMX kernels are faster there)."""

    def __init__(self, w_uk: torch.Tensor, w_uv: torch.Tensor):  # [heads, nope, rank], [heads, v, rank]
        self.num_heads = w_uk.shape[0]
        self.key = cpu_moe.pack(w_uk.transpose(1, 2))  # per head [out = rank, in = nope]
        self.value = cpu_moe.pack(w_uv)  # per head [out = v, in = rank]

    def queries(self, q_nope: torch.Tensor) -> torch.Tensor | None:
        return self._per_head(q_nope, self.key)

    def outputs(self, out_latent: torch.Tensor) -> torch.Tensor | None:
        return self._per_head(out_latent, self.value)

    def _per_head(self, rows: torch.Tensor, weights: cpu_moe.PackedExperts) -> torch.Tensor | None:
        num_rows = rows.shape[0]
        if rows.dtype != torch.bfloat16 or (
                cpu_moe.MAX_ROWS_PER_EXPERT is not None and num_rows > cpu_moe.MAX_ROWS_PER_EXPERT):
            return None
        grouped = rows.transpose(0, 1).reshape(self.num_heads * num_rows, rows.shape[-1])  # head-major
        out = cpu_moe.grouped_gemm(grouped, cpu_moe.equal_groups(self.num_heads, num_rows), weights)
        return out.view(self.num_heads, num_rows, -1).transpose(0, 1)
