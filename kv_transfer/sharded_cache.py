"""A tensor-parallel worker's KV cache as the transfer sees it: one full-head cache whose heads live in its ranks.

Each rank of a worker with ``tensor_parallel_size`` N holds the KV heads its attention reads
(``pipeline.parallel.shard_spec``: a block of K/N heads, or one head several ranks share when K < N) in a cache of
its own, ``[num_layers, 2, num_blocks, page_size, local_heads, head_dim]``, with the same block ids on every rank.
``ShardedKVCache`` puts those shards (mapped from shared memory, ``pipeline.parallel.kv_shards``) behind the full
cache's shape ``[num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim]``: a piece is packed from the
shards that own its heads, straight into the frame that travels, and lands straight in every shard that holds
them (a head shared by several ranks is written into each). So what travels is the full-head layout whatever the
two ends' tensor-parallel sizes: the bytes equal a TP 1 -> TP 1 transfer's, the checksum is the same stream's, and
either end re-slices for its own ranks alone (a prefill worker with 2 ranks and a decode worker with 1, or the
reverse, or 2 and 4, agree on the wire with no knowledge of each other). A latent cache (multi-head latent
attention: ``[num_layers, 1, num_blocks, page_size, 1, latent_dim]``) is whole on every rank: one "head" every
shard holds, packed from the first and landed in each.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kv_transfer.blocks import runs


class ShardedKVCache:
    """The ranks' caches ``shards[r]`` holding the full model's KV heads ``[first_heads[r], first_heads[r] +
    shards[r].shape[4])``; ``shape`` / ``dtype`` / ``device`` are the full cache's, as the layout reads them."""

    def __init__(self, shards: Sequence[torch.Tensor], first_heads: Sequence[int], num_kv_heads: int) -> None:
        if not shards or len(shards) != len(first_heads):
            raise ValueError(f"shards and first_heads: one first head per shard (got {len(shards)} shards, "
                             f"{len(first_heads)} first heads)")
        base = shards[0]
        for rank, shard in enumerate(shards):
            if shard.dim() != 6 or shard.shape[1] not in (1, 2):
                raise ValueError(f"shard {rank}: must be [num_layers, 2 (or 1: a latent cache), num_blocks, page_size, "
                                 f"heads, head_dim] (got shape {tuple(shard.shape)})")
            same = (shard.shape[:4] == base.shape[:4] and shard.shape[5] == base.shape[5]
                    and shard.dtype == base.dtype and shard.device == base.device)
            if not same or not shard.is_contiguous():
                raise ValueError(f"shard {rank}: {tuple(shard.shape)} {shard.dtype} on {shard.device} does not match "
                                 f"shard 0's {tuple(base.shape)} {base.dtype} on {base.device}, or is not contiguous")
            if not 0 <= first_heads[rank] <= num_kv_heads - shard.shape[4]:
                raise ValueError(f"shard {rank}: heads [{first_heads[rank]}, {first_heads[rank] + shard.shape[4]}) "
                                 f"outside the model's {num_kv_heads}")
        self.shards = list(shards)
        self.first_heads = [int(h) for h in first_heads]
        self.shape = torch.Size([*base.shape[:4], num_kv_heads, base.shape[5]])
        self.dtype, self.device = base.dtype, base.device
        self._owners = self._owner_runs(num_kv_heads)

    def __len__(self) -> int:
        return len(self.shards)

    def _owner_runs(self, num_kv_heads: int) -> list[tuple[int, int, int]]:
        """``(shard, first full head, count)`` runs that read every head once, from the first shard holding it."""
        owner = [None] * num_kv_heads
        for index, (first, shard) in enumerate(zip(self.first_heads, self.shards)):
            for head in range(first, first + shard.shape[4]):
                if owner[head] is None:
                    owner[head] = index
        missing = [head for head, index in enumerate(owner) if index is None]
        if missing:
            raise ValueError(f"KV heads {missing} are in no shard")
        out: list[tuple[int, int, int]] = []
        for head, index in enumerate(owner):
            if out and out[-1][0] == index and out[-1][1] + out[-1][2] == head:
                out[-1] = (index, out[-1][1], out[-1][2] + 1)
            else:
                out.append((index, head, 1))
        return out

    def pack(self, block_ids: Sequence[int], layers: slice) -> torch.Tensor:
        """Blocks ``block_ids`` of ``layers`` in the full layout ``[layers, 2, n, page_size, num_kv_heads, head_dim]``
        (contiguous), each head read from the shard that owns it: one strided copy per (owner, run of blocks)."""
        num_layers = len(range(*layers.indices(self.shape[0])))
        packed = torch.empty((num_layers, self.shape[1], len(block_ids), *self.shape[3:]), dtype=self.dtype,
                             device=self.device)
        for index, head, count in self._owners:
            local = head - self.first_heads[index]
            source = self.shards[index][layers, :, :, :, local:local + count]
            for at, first, length in runs(block_ids):
                packed[:, :, at:at + length, :, head:head + count].copy_(source[:, :, first:first + length])
        return packed

    def unpack(self, packed: torch.Tensor, block_ids: Sequence[int], layers: slice) -> None:
        """Write a full-layout piece (``pack``'s shape) into blocks ``block_ids`` of every shard, each its own heads."""
        for first_head, shard in zip(self.first_heads, self.shards):
            heads = packed[:, :, :, :, first_head:first_head + shard.shape[4]]
            target = shard[layers]
            for at, first, length in runs(block_ids):
                target[:, :, first:first + length].copy_(heads[:, :, at:at + length])
