"""Paged attention on the CPU: the native kernel (``kernels/native``) where it applies, else the torch reference.

The native kernel reads K/V in place from the pages through the block table, with an online softmax
per query row, instead of gathering each sequence's pages into a padded copy first; its contract is
``paged_attention_ref``'s, which stays the oracle in tests and the path for what the kernel does not
take (a CPU build without the module, fp16, a layout that is not contiguous per token, and layers with
attention sinks: gpt-oss's, whose softmax the native kernel does not take yet).
"""

from __future__ import annotations

import torch

from kernels import cpu_native
from kernels.paged_attention_ref import paged_attention_ref

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def native_applies(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the native kernel takes these tensors (else the reference runs)."""
    return (
        cpu_native.ops is not None
        and query.device.type == "cpu"
        and query.dtype in _DTYPE_CODES
        and k_cache.dtype == query.dtype
        and v_cache.dtype == query.dtype
        and query.stride(-1) == 1
        and query.stride(-2) == query.shape[-1]
        and k_cache.stride(-1) == 1
        and v_cache.stride(-1) == 1
        and k_cache.stride(-2) == k_cache.shape[-1]
        and v_cache.stride(-2) == v_cache.shape[-1]
    )


def paged_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_q_heads] attention-sink logits (gpt-oss): the reference runs them
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    if sinks is not None or not native_applies(query, k_cache, v_cache):
        return paged_attention_ref(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                                   sliding_window, sinks)
    cu_seqlens_q = cu_seqlens_q.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    block_tables = block_tables.to(torch.int32)
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    num_tokens, num_q_heads, head_dim = query.shape
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype)
    if num_tokens == 0:
        return out
    cpu_native.ops.paged_attention(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        cu_seqlens_q.data_ptr(), context_lens.data_ptr(), block_tables.data_ptr(),
        context_lens.numel(), num_q_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
        _DTYPE_CODES[query.dtype], sliding_window or 0,
        query.stride(0), out.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0) if block_tables.dim() == 2 else 0,
        float(scale), torch.get_num_threads(),
    )
    return out
