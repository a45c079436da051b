"""A tensor-parallel prefill or decode worker's KV as its transfer moves it: every rank's cache as one
``ShardedKVCache`` (rank 0's own, the others' mapped from the shared memory each rank allocated), so the
transfer packs each head from the rank that holds it and lands it in every rank that holds it, with no
collective and no copy through rank 0's cache (docs/tensor-parallel.md, "Prefill and decode workers")."""

from __future__ import annotations

import torch

from kv_transfer.sharded_cache import ShardedKVCache
from pipeline.parallel.shard_spec import ShardSpec, TensorParallelError


def sharded_kv_cache(rank_group, hf_config, kv_cache: torch.Tensor) -> ShardedKVCache:
    """Rank 0's ``kv_cache`` and ranks 1..N-1's (``rank_group.share_kv_caches``, before the first forward), each
    with its first KV head of the full model (``ShardSpec.first_kv_head``)."""
    size = rank_group.size
    if kv_cache.device.type != "cpu":
        raise TensorParallelError(f"a prefill or decode worker with tensor_parallel_size={size} runs on CPU only: "
                                  "moving each GPU rank's KV (CUDA IPC per rank) is not built yet")
    specs = [ShardSpec.of(hf_config, rank, size) for rank in range(size)]
    others = rank_group.share_kv_caches(kv_cache.shape, kv_cache.dtype)
    return ShardedKVCache([kv_cache, *others], [spec.first_kv_head for spec in specs], specs[0].num_kv_heads)
