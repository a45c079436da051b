"""Build a worker's compatibility record from its KV cache tensor, and check a tensor against one."""

from __future__ import annotations

from typing import Sequence

import torch

from kv_transfer.sharded_cache import ShardedKVCache
from pipeline.protocol.transfer import IN_PLACE_TRANSPORTS, KV_KINDS, TRANSPORTS, KVLayout

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}
TORCH_DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def kv_layout(kv_cache: torch.Tensor | ShardedKVCache, model_hash: str, transport: str = "auto",
              layer_windows: Sequence[int | None] = ()) -> KVLayout:
    """The record of ``kv_cache`` ``[num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim]``, or of a
    latent cache ``[num_layers, 1, num_blocks, page_size, 1, latent_dim]`` (multi-head latent attention), or of
    a tensor-parallel worker's ranks (``ShardedKVCache``: the full cache's record, its ``tensor_parallel_size``).

    ``transport`` is "auto" (CUDA IPC between GPU caches on one host, shared memory on one host, else ZMQ) or one
    name of ``TRANSPORTS`` to force it; an end whose cache is not shared memory drops "shm" by itself, one whose
    cache is not on a GPU drops "cuda_ipc", and a sharded cache only moves over ZMQ (its pieces are re-sliced as
    they are packed and landed, never written in place).
    ``layer_windows``: each layer's sliding attention window (None or 0: full attention), or empty when every
    layer is full.
    """
    if transport != "auto" and transport not in TRANSPORTS:
        raise ValueError(f"transport: must be 'auto' or one of {', '.join(TRANSPORTS)} (got {transport!r})")
    _check_shape(kv_cache)
    sharded = isinstance(kv_cache, ShardedKVCache)
    if sharded and transport in IN_PLACE_TRANSPORTS:
        raise ValueError(f"transport: {transport!r} writes one cache in place; a worker with tensor_parallel_size "
                         f"{len(kv_cache)} moves its ranks' KV over 'zmq' (or 'auto')")
    transports = TRANSPORTS if transport == "auto" else (transport,)
    num_layers, pages_per_layer, _, page_size, num_kv_heads, head_dim = kv_cache.shape
    return KVLayout(
        model_hash=model_hash,
        dtype=DTYPE_NAMES[kv_cache.dtype],
        page_size=page_size,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        transports=tuple(t for t in transports if t not in IN_PLACE_TRANSPORTS) if sharded else transports,
        kv_kind=next(kind for kind, pages in KV_KINDS.items() if pages == pages_per_layer),
        layer_windows=tuple(int(window or 0) for window in layer_windows) if any(layer_windows) else (),
        tensor_parallel_size=len(kv_cache) if sharded else 1,
    )


def check_kv_cache(kv_cache: torch.Tensor | ShardedKVCache, layout: KVLayout) -> None:
    """Raise ``ValueError`` naming every field where ``kv_cache`` disagrees with ``layout``."""
    _check_shape(kv_cache)
    actual = kv_layout(kv_cache, layout.model_hash, layer_windows=layout.layer_windows)
    problems = layout.mismatch(actual, ours="record", theirs="kv_cache")
    if problems:
        raise ValueError("kv_cache does not match its KVLayout: " + "; ".join(problems))


def _check_shape(kv_cache: torch.Tensor | ShardedKVCache) -> None:
    is_kv = len(kv_cache.shape) == 6 and kv_cache.shape[1] == 2
    is_latent = len(kv_cache.shape) == 6 and kv_cache.shape[1] == 1 and kv_cache.shape[4] == 1
    if not (is_kv or is_latent):
        raise ValueError(
            "kv_cache: must be [num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim] "
            f"or latent [num_layers, 1, num_blocks, page_size, 1, latent_dim] (got shape {tuple(kv_cache.shape)})"
        )
    if kv_cache.dtype not in DTYPE_NAMES:
        raise ValueError(f"kv_cache: dtype must be one of {', '.join(DTYPE_NAMES.values())} (got {kv_cache.dtype})")
    if isinstance(kv_cache, torch.Tensor) and not kv_cache.is_contiguous():  # a ShardedKVCache checked its shards
        raise ValueError("kv_cache: must be contiguous")
