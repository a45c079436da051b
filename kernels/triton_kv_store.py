"""Triton twin of ``kv_store_ref``: write new K/V rows into the paged cache through a slot mapping.

One program per token writes all of its heads for K and V; a slot of -1 (a padding token, or a token
whose KV is already cached) writes nothing. Caches are addressed through their strides, so the
per-layer views ``kv_cache[l, 0]`` / ``kv_cache[l, 1]`` of the one KV tensor are used in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import check_dtype, check_launchable, next_pow2, num_warps_for


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    num_kv_heads,
    stride_key_t, stride_key_h, stride_key_d,
    stride_value_t, stride_value_h, stride_value_d,
    stride_kc_b, stride_kc_p, stride_kc_h, stride_kc_d,
    stride_vc_b, stride_vc_p, stride_vc_h, stride_vc_d,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    dims = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    is_kept = tl.full([BLOCK_H, BLOCK_D], 0, tl.int64) + slot >= 0  # a tile, not a scalar: the CPU
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM) & is_kept  # interpreter cannot broadcast scalar masks

    k = tl.load(key_ptr + token * stride_key_t + heads * stride_key_h + dims * stride_key_d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_b + offset * stride_kc_p + heads * stride_kc_h + dims * stride_kc_d
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)

    v = tl.load(value_ptr + token * stride_value_t + heads * stride_value_h + dims * stride_value_d, mask=mask)
    v_dst = v_cache_ptr + block * stride_vc_b + offset * stride_vc_p + heads * stride_vc_h + dims * stride_vc_d
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * page_size + offset; -1 = skip
) -> None:
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    check_launchable(_store_kv_kernel, key, value, k_cache, v_cache, slot_mapping)
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(name, t)
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    if key.shape[1:] != (num_kv_heads, head_dim) or value.shape != key.shape or v_cache.shape != k_cache.shape:
        raise ValueError(f"store_kv: key {tuple(key.shape)} / value {tuple(value.shape)} do not match "
                         f"cache {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    block_h, block_d = next_pow2(num_kv_heads), next_pow2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        num_kv_heads,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=num_warps_for(block_h * block_d),
    )
