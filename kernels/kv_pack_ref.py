"""Torch reference: gather a request's KV blocks into one contiguous buffer and scatter it back.

The KV cache of a worker is one tensor ``[num_layers, 2, num_blocks, page_size, num_kv_heads,
head_dim]``. A transfer buffer holds the blocks of one request, layer-major:
``[num_layers, 2, n, page_size, num_kv_heads, head_dim]`` so that one layer's slice is contiguous too.
"""

from __future__ import annotations

import torch


def pack_kv_blocks_ref(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] int64
    layers: slice = slice(None),
) -> torch.Tensor:  # [num_selected_layers, 2, n, page_size, num_kv_heads, head_dim]
    return kv_cache[layers].index_select(2, block_ids.to(kv_cache.device)).contiguous()


def unpack_kv_blocks_ref(
    buffer: torch.Tensor,  # [num_selected_layers, 2, n, page_size, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] int64
    layers: slice = slice(None),
) -> None:
    kv_cache[layers].index_copy_(2, block_ids.to(kv_cache.device), buffer.to(kv_cache.dtype))
