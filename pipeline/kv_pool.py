"""An engine's KV pool: how many blocks fit (the draft's KV counted), the block manager, and the cache
tensor(s), placed by the caller's allocator (e.g. in shared memory for the same-host transfer), and the longest
sequence it can hold."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from pipeline.config import ConfigError, PipelineConfig
from pipeline.kv_cache import KVCacheManager
from pipeline.model_runner import bytes_per_block, determine_num_blocks, kv_cache_shape

log = logging.getLogger(__name__)


@dataclass
class KVPool:
    manager: KVCacheManager
    kv_cache: torch.Tensor  # [layers, 2, num_blocks, page_size, kv_heads, head_dim] (the draft's layers last)
    draft_kv_cache: torch.Tensor | None  # the draft's view of ``kv_cache``, a tensor of its own, or None

    @property
    def num_blocks(self) -> int:
        return self.manager.num_total_blocks


def build_kv_pool(config: PipelineConfig, hf_config, draft, max_length: int, dtype: torch.dtype, device: str,
                  allocator: Callable | None = None) -> KVPool:
    """``allocator(shape, dtype, device)`` places the cache a transfer reads; default: a zeroed tensor."""
    page_size = config.kv_cache.page_size
    num_lookahead = config.speculative.num_speculative_tokens
    max_useful = config.max_batch_size * -(-(max_length + num_lookahead) // page_size) + 1
    draft_bytes = bytes_per_block(draft.hf_config, page_size, dtype) if draft is not None else 0
    tp = config.tensor_parallel_size  # each rank's budget holds its own share of the KV heads
    num_blocks = determine_num_blocks(config.kv_cache, hf_config, dtype, device, max_useful,
                                      extra_bytes_per_block=draft_bytes, tensor_parallel_size=tp)

    def allocate(shape):
        if allocator is None:
            return torch.zeros(shape, dtype=dtype, device=device)
        return allocator(shape, dtype, device)

    shape = kv_cache_shape(hf_config, num_blocks, page_size, tp)
    if draft is None:
        kv_cache, draft_kv_cache = allocate(shape), None
    else:
        from pipeline.speculative.draft import allocate_kv_caches

        kv_cache, draft_kv_cache = allocate_kv_caches(shape, kv_cache_shape(draft.hf_config, num_blocks, page_size),
                                                      allocate, config.pipeline_role, is_target_split=tp > 1)
    manager = KVCacheManager(num_blocks, page_size, config.kv_cache.enable_prefix_caching)
    return KVPool(manager, kv_cache, draft_kv_cache)


def servable_length(manager: KVCacheManager, max_length: int, num_lookahead: int) -> int:
    """``max_length``, or less when the pool cannot hold one sequence that long (with its draft positions): such
    a sequence could never run, and waiting at the head of the queue it would stall every request behind it. The
    worker registers the length it serves: the router sends it no longer prompt, and ends outputs there."""
    page_size, num_blocks = manager.page_size, manager.num_total_blocks
    capacity = num_blocks * page_size - num_lookahead
    if capacity >= max_length:
        return max_length
    if capacity < 2:
        raise ConfigError(f"kv_cache: {num_blocks} blocks of {page_size} tokens cannot hold a prompt and a token; "
                          "raise kv_cache.num_blocks (or cpu_kv_cache_gib)")
    log.warning("the KV pool (%d blocks of %d tokens) holds one sequence of %d tokens, fewer than max_length %d: "
                "serving sequences of up to %d tokens; raise kv_cache.num_blocks / cpu_kv_cache_gib (or set "
                "max_length) to serve longer ones", num_blocks, page_size, capacity, max_length, capacity)
    return capacity
