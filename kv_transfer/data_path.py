"""Moving the bytes of one piece: pack for the wire, copy in place (shm) or land a frame, checksumming each.

On the CPU every copy is one ``numpy.copyto`` per run of consecutive blocks, over byte views of the
caches (``byte_pages``): a run is one contiguous stretch per (layer, K/V), which numpy moves with libc
``memcpy`` (1.3-1.6x the speed of torch's ``copy_`` loop here), with no index tensor and no temporary.
The checksum is always taken from a KV cache (the source on P, the destination on D), run by run right
after that run was copied, while much of it is still in CPU cache. On a GPU the kernels (``pack_kv_blocks`` /
``unpack_kv_blocks``) move a piece in one launch and the checksum runs on the device.

Sending views of the cache instead of packing (zero-copy, one frame per (layer, K/V, run)) was measured
and dropped: with the block-major pieces used here a region is at most one piece's blocks (4, 128 KiB,
with the bench layout), and the per-frame costs on both sides exceed the memcpy it saves
(docs/benchmarks.md, "KV transfer").
"""

from __future__ import annotations

import collections
import math

import numpy as np
import torch

from kernels import Kernels
from kv_transfer.blocks import Piece, paired_runs, runs
from kv_transfer.checksum import KVChecksum


def byte_pages(kv_cache: torch.Tensor) -> np.ndarray | None:
    """``[num_layers, 2, num_blocks, page_bytes]`` uint8 view of a CPU cache (None on other devices)."""
    if kv_cache.device.type != "cpu":
        return None
    num_layers, _, num_blocks = kv_cache.shape[:3]
    return kv_cache.view(torch.uint8).view(num_layers, 2, num_blocks, -1).numpy()


class PackBuffers:
    """Pack buffers reused once ZMQ let go of them (it reports that through a ``MessageTracker``): a
    fresh multi-MiB buffer per piece costs page faults and zeroing, since glibc hands a freed heap top
    back to the OS (measured: ~15% of the sender's time). At most ``max_free`` idle buffers are kept."""

    def __init__(self, buffer_bytes: int, max_free: int) -> None:
        self.buffer_bytes, self.max_free = buffer_bytes, max_free
        self._free: list[np.ndarray] = []
        self._lent: collections.deque[tuple[np.ndarray, object]] = collections.deque()

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of at least ``nbytes`` that nothing else uses."""
        while self._lent and self._lent[0][1].done:
            buffer = self._lent.popleft()[0]
            if len(self._free) < self.max_free:
                self._free.append(buffer)
        for i, buffer in enumerate(self._free):
            if buffer.nbytes >= nbytes:
                return self._free.pop(i)
        return np.empty(max(nbytes, self.buffer_bytes), dtype=np.uint8)

    def lend(self, buffer: np.ndarray, tracker) -> None:
        """``buffer`` went out in a message ``tracker`` (``.done``) follows; it comes back when done."""
        self._lent.append((buffer, tracker))


def pack_piece(
    kernels: Kernels, kv_cache: torch.Tensor, pages: np.ndarray | None, piece: Piece, checksum: KVChecksum,
    buffers: PackBuffers,
) -> tuple[np.ndarray, np.ndarray | None]:
    """P, zmq: the piece packed ``[layers, 2, n, page_bytes]`` (to send with ``copy=False``), and the buffer
    of ``buffers`` it lives in (None for device memory copied out)."""
    layers, src_ids = piece.layers, piece.src_block_ids
    if pages is None:
        packed = kernels.pack_kv_blocks(kv_cache, torch.tensor(src_ids, dtype=torch.int64), layers)
        checksum.update_packed(packed)  # on the device: no extra host copy
        return packed.cpu().reshape(-1).view(torch.uint8).numpy(), None
    shape = (layers.stop - layers.start, 2, len(src_ids), pages.shape[-1])
    buffer = buffers.take(math.prod(shape))
    packed = buffer[: math.prod(shape)].reshape(shape)
    sums, src_pages = [], pages[layers]
    for index, first, length in runs(src_ids):
        np.copyto(packed[:, :, index : index + length], src_pages[:, :, first : first + length])
        sums.append(checksum.block_sums(kv_cache, layers, first, length))  # the source run, still hot
    checksum.add_block_sums(torch.cat(sums, dim=2))
    return packed, buffer


def write_piece_in_place(
    kv_cache: torch.Tensor, pages: np.ndarray, dst_pages: np.ndarray, piece: Piece, checksum: KVChecksum
) -> None:
    """P, shm: copy the piece straight into the receiver's mapped cache (``dst_pages``), one copy per run."""
    layers, sums = piece.layers, []
    src_pages, dst_pages = pages[layers], dst_pages[layers]
    for src, dst, n in paired_runs(piece.src_block_ids, piece.dst_block_ids):
        np.copyto(dst_pages[:, :, dst : dst + n], src_pages[:, :, src : src + n])
        sums.append(checksum.block_sums(kv_cache, layers, src, n))  # the source run, still hot
    checksum.add_block_sums(torch.cat(sums, dim=2))


def land_piece(
    kernels: Kernels, kv_cache: torch.Tensor, pages: np.ndarray | None, dst_block_ids: list[int], layers: slice,
    frame: memoryview | None, checksum: KVChecksum,
) -> None:
    """D: copy ``frame`` (zmq; its size already checked) into ``dst_block_ids``, or take bytes already there
    (shm); then checksum what landed, from the cache itself."""
    if frame is None:
        return checksum.update_blocks(kv_cache, dst_block_ids, layers)
    num_layers, n = layers.stop - layers.start, len(dst_block_ids)
    if pages is None:
        # [num_layers, 2, n, page_size, num_kv_heads, head_dim], a view of ZMQ's receive buffer
        packed = torch.frombuffer(frame, dtype=torch.uint8).view(kv_cache.dtype).view(
            num_layers, 2, n, *kv_cache.shape[3:])
        ids = torch.tensor(dst_block_ids, dtype=torch.int64)
        kernels.unpack_kv_blocks(packed.to(kv_cache.device), kv_cache, ids, layers)
        return checksum.update_blocks(kv_cache, dst_block_ids, layers)
    packed = np.frombuffer(frame, dtype=np.uint8).reshape(num_layers, 2, n, pages.shape[-1])
    sums, dst_pages = [], pages[layers]
    for index, first, length in runs(dst_block_ids):
        np.copyto(dst_pages[:, :, first : first + length], packed[:, :, index : index + length])
        sums.append(checksum.block_sums(kv_cache, layers, first, length))  # what landed, still hot
    checksum.add_block_sums(torch.cat(sums, dim=2))
