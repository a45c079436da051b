"""Moving the bytes of one piece: pack for the wire, copy in place (shm) or land a frame, checksumming each.

Every copy goes through the kernels (``pack_kv_blocks`` / ``unpack_kv_blocks``) except the shm copy,
which is one strided ``copy_`` per run of consecutive blocks straight into the receiver's cache. The
checksum is always taken from a KV cache (the source on P, the destination on D), right next to the
copy so the data is still in CPU cache.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels import Kernels
from kv_transfer.blocks import Piece, paired_runs
from kv_transfer.checksum import KVChecksum


def pack_piece(kernels: Kernels, kv_cache: torch.Tensor, piece: Piece, checksum: KVChecksum) -> torch.Tensor:
    """P, zmq: the piece packed contiguously on the CPU, ``[layers, 2, n, page_size, num_kv_heads, head_dim]``."""
    src_ids = torch.tensor(piece.src_block_ids, dtype=torch.int64)
    packed = kernels.pack_kv_blocks(kv_cache, src_ids, piece.layers)
    checksum.update_packed(packed)  # on the cache's device: no extra host copy on GPU
    return packed.cpu()


def as_frame(packed: torch.Tensor) -> np.ndarray:
    """A zero-copy byte view of a CPU tensor that ZMQ can send with ``copy=False`` (and keeps alive)."""
    return packed.reshape(-1).view(torch.uint8).numpy()


def write_piece_in_place(kv_cache: torch.Tensor, dst_cache: torch.Tensor, piece: Piece, checksum: KVChecksum) -> None:
    """P, shm: copy the piece straight into the receiver's mapped cache, one copy per run of blocks."""
    layers, sums = piece.layers, []
    for src, dst, n in paired_runs(piece.src_block_ids, piece.dst_block_ids):
        sums.append(checksum.block_sums(kv_cache, layers, src, n))  # reads the source run...
        dst_cache[layers, :, dst : dst + n].copy_(kv_cache[layers, :, src : src + n])  # ...copied while hot
    checksum.add_block_sums(torch.cat(sums, dim=2))


def land_piece(
    kernels: Kernels, kv_cache: torch.Tensor, dst_block_ids: list[int], layers: slice, frame: memoryview | None,
    checksum: KVChecksum,
) -> None:
    """D: unpack ``frame`` (zmq) into ``dst_block_ids``, or take bytes already there (shm); then checksum
    what landed, from the cache itself."""
    if frame is not None:
        num_layers = layers.stop - layers.start
        # [num_layers, 2, n, page_size, num_kv_heads, head_dim], a view of ZMQ's receive buffer
        packed = torch.frombuffer(frame, dtype=torch.uint8).view(kv_cache.dtype).view(
            num_layers, 2, len(dst_block_ids), *kv_cache.shape[3:])
        ids = torch.tensor(dst_block_ids, dtype=torch.int64)
        kernels.unpack_kv_blocks(packed.to(kv_cache.device), kv_cache, ids, layers)
    checksum.update_blocks(kv_cache, dst_block_ids, layers)
