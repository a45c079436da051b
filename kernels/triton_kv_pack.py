"""Triton twins of ``kv_pack_ref``: gather a request's KV blocks into a contiguous transfer buffer
and scatter such a buffer into (another cache's) blocks, for all layers or a ``layers`` slice.

The cache is ``[num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim]`` (a latent cache has one
page per layer and block: ``[num_layers, 1, ...]``) and the buffer ``[num_selected_layers, 2 or 1, n, ...]``;
one block of one layer's K or V (or latent) page is a ``page_size * num_kv_heads * head_dim`` run, contiguous
in any cache built as one tensor, so a program copies a chunk of one such run with flat offsets. One kernel serves both directions: packing
and unpacking differ only in which side is indexed through ``block_ids``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import check_dtype, check_launchable, next_pow2, num_warps_for

MAX_CHUNK = 4096  # elements one program copies


@triton.jit
def _copy_blocks_kernel(
    cache_ptr, buffer_ptr, block_ids_ptr,
    num_ids, pages_per_layer, layer_start, layer_step, inner, page_size, num_kv_heads, head_dim,
    stride_c_l, stride_c_kv, stride_c_b, stride_c_p, stride_c_h, stride_c_d,
    stride_b_l, stride_b_kv, stride_b_b, stride_b_p, stride_b_h, stride_b_d,
    TO_BUFFER: tl.constexpr, FLAT_INNER: tl.constexpr, BLOCK: tl.constexpr,
):
    run = tl.program_id(0)  # (selected layer, k|v (or the latent page), i-th block id), flattened
    chunk = tl.program_id(1)
    idx = run % num_ids
    kv = (run // num_ids) % pages_per_layer
    layer = run // (num_ids * pages_per_layer)
    block = tl.load(block_ids_ptr + idx).to(tl.int64)
    cache_run = (cache_ptr + (layer_start + layer * layer_step).to(tl.int64) * stride_c_l + kv * stride_c_kv
                 + block * stride_c_b)
    buffer_run = buffer_ptr + layer.to(tl.int64) * stride_b_l + kv * stride_b_kv + idx.to(tl.int64) * stride_b_b

    offs = chunk * BLOCK + tl.arange(0, BLOCK)  # flat index inside the [page_size, num_kv_heads, head_dim] run
    mask = offs < inner
    if FLAT_INNER:
        cache_offs = offs
        buffer_offs = offs
    else:  # a strided cache view: unflatten the run index (slower, but any layout works)
        d = offs % head_dim
        h = (offs // head_dim) % num_kv_heads
        p = offs // (head_dim * num_kv_heads)
        cache_offs = p * stride_c_p + h * stride_c_h + d * stride_c_d
        buffer_offs = p * stride_b_p + h * stride_b_h + d * stride_b_d
    if TO_BUFFER:
        values = tl.load(cache_run + cache_offs, mask=mask)
        tl.store(buffer_run + buffer_offs, values.to(buffer_ptr.dtype.element_ty), mask=mask)
    else:
        values = tl.load(buffer_run + buffer_offs, mask=mask)
        tl.store(cache_run + cache_offs, values.to(cache_ptr.dtype.element_ty), mask=mask)


def pack_kv_blocks_triton(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] int64
    layers: slice = slice(None),
) -> torch.Tensor:  # [num_selected_layers, 2, n, page_size, num_kv_heads, head_dim]
    layer_ids = range(*layers.indices(kv_cache.shape[0]))
    block_ids = block_ids.to(kv_cache.device)
    buffer = torch.empty((len(layer_ids), kv_cache.shape[1], block_ids.numel(), *kv_cache.shape[3:]),
                         dtype=kv_cache.dtype, device=kv_cache.device)
    _launch(kv_cache, buffer, block_ids, layer_ids, to_buffer=True)
    return buffer


def unpack_kv_blocks_triton(
    buffer: torch.Tensor,  # [num_selected_layers, 2, n, page_size, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n] int64
    layers: slice = slice(None),
) -> None:
    layer_ids = range(*layers.indices(kv_cache.shape[0]))
    block_ids = block_ids.to(kv_cache.device)
    expected = (len(layer_ids), kv_cache.shape[1], block_ids.numel(), *kv_cache.shape[3:])
    if tuple(buffer.shape) != expected:
        raise ValueError(f"unpack_kv_blocks: buffer {tuple(buffer.shape)} does not match {expected} "
                         f"(layers {layers}, {block_ids.numel()} blocks)")
    _launch(kv_cache, buffer.to(kv_cache.device), block_ids, layer_ids, to_buffer=False)


def _launch(kv_cache: torch.Tensor, buffer: torch.Tensor, block_ids: torch.Tensor, layer_ids: range,
            to_buffer: bool) -> None:
    num_runs = len(layer_ids) * kv_cache.shape[1] * block_ids.numel()
    if num_runs == 0:
        return
    check_launchable(_copy_blocks_kernel, kv_cache, buffer, block_ids)
    check_dtype("kv_cache", kv_cache)
    check_dtype("buffer", buffer)
    page_size, num_kv_heads, head_dim = kv_cache.shape[3:]
    inner = page_size * num_kv_heads * head_dim
    flat_inner = _is_flat(kv_cache) and _is_flat(buffer)
    block = min(next_pow2(inner), MAX_CHUNK)
    _copy_blocks_kernel[(num_runs, triton.cdiv(inner, block))](
        kv_cache, buffer, block_ids,
        block_ids.numel(), kv_cache.shape[1], layer_ids.start, layer_ids.step, inner, page_size, num_kv_heads, head_dim,
        *kv_cache.stride(), *buffer.stride(),
        TO_BUFFER=to_buffer, FLAT_INNER=flat_inner, BLOCK=block, num_warps=num_warps_for(block),
    )


def _is_flat(t: torch.Tensor) -> bool:
    """Whether the trailing [page_size, num_kv_heads, head_dim] dims are laid out row-major and dense."""
    page_size, num_kv_heads, head_dim = t.shape[3:]
    expected = (num_kv_heads * head_dim, head_dim, 1)
    return all(size == 1 or stride == want for size, stride, want in zip(t.shape[3:], t.stride()[3:], expected))
