"""Moving the bytes of one piece: pack for the wire, copy in place (shm, cuda_ipc) or land a frame, checksumming each.

On the CPU a piece is one call of the native copy-and-checksum (``kv_transfer.native``) over byte views
of the caches (``byte_pages``): every (layer, K/V) stretch of every run of consecutive blocks is read
once, for the copy and the checksum together. Without the extension, each run is one ``numpy.copyto``
(libc ``memcpy``) followed by the torch checksum of the run while it is still in CPU cache. The
checksum is taken over what is copied: P's source pages, and on D the pages as they land (zmq) or as
they sit in the cache (shm, where P wrote them). On a GPU the kernels (``pack_kv_blocks`` /
``unpack_kv_blocks``) move a piece in one launch and the checksum runs on the device; with CUDA IPC the
piece is gathered on P's device and scattered into D's cache, opened in P's process (``write_piece_on_device``).

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
from kv_transfer import native
from kv_transfer.blocks import Piece, paired_runs, runs
from kv_transfer.checksum import KVChecksum
from kv_transfer.cuda_ipc import synchronize
from kv_transfer.sharded_cache import ShardedKVCache


def byte_pages(kv_cache: torch.Tensor | ShardedKVCache) -> np.ndarray | None:
    """``[num_layers, pages_per_layer, num_blocks, page_bytes]`` uint8 view of a CPU cache (None on other devices,
    and for a tensor-parallel worker's ranks, whose pieces go through ``ShardedKVCache``); ``pages_per_layer`` is 2
    (K, V) or 1 (a latent cache)."""
    if isinstance(kv_cache, ShardedKVCache) or kv_cache.device.type != "cpu":
        return None
    num_layers, pages_per_layer, num_blocks = kv_cache.shape[:3]
    return kv_cache.view(torch.uint8).view(num_layers, pages_per_layer, num_blocks, -1).numpy()


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
    """P, zmq: the piece packed ``[layers, pages_per_layer, n, page_bytes]`` (to send with ``copy=False``), and the
    buffer of ``buffers`` it lives in (None for device memory copied out)."""
    layers, src_ids = piece.layers, piece.src_block_ids
    if pages is None:
        if isinstance(kv_cache, ShardedKVCache):  # the full heads, from the ranks that own them
            packed = kv_cache.pack(src_ids, layers)
        else:
            packed = kernels.pack_kv_blocks(kv_cache, torch.tensor(src_ids, dtype=torch.int64), layers)
        checksum.update_packed(packed)  # on the device: no extra host copy
        return packed.cpu().reshape(-1).view(torch.uint8).numpy(), None
    per_layer = pages.shape[1]
    shape = (layers.stop - layers.start, per_layer, len(src_ids), pages.shape[-1])
    buffer = buffers.take(math.prod(shape))
    packed = buffer[: math.prod(shape)].reshape(shape)
    if checksum.native_subrow_bytes:
        indexes, firsts, lengths = zip(*runs(src_ids))
        rows = range(per_layer * layers.start, per_layer * layers.stop)
        segments = native.segments(range(len(rows)), len(src_ids), indexes, rows, pages.shape[2], firsts, lengths,
                                   pages.shape[-1])
        checksum.copy_native(buffer, pages, segments)
        return packed, buffer
    sums, src_pages = [], pages[layers]
    for index, first, length in runs(src_ids):
        np.copyto(packed[:, :, index : index + length], src_pages[:, :, first : first + length])
        sums.append(checksum.block_sums(kv_cache, layers, first, length))  # the source run, still hot
    checksum.add_block_sums(torch.cat(sums, dim=2))
    return packed, buffer


def write_piece_in_place(
    kv_cache: torch.Tensor, pages: np.ndarray, dst_pages: np.ndarray, piece: Piece, checksum: KVChecksum
) -> None:
    """P, shm: copy the piece straight into the receiver's mapped cache (``dst_pages``), checksumming the
    source as it goes (one native call, or one copy per run then its checksum)."""
    layers = piece.layers
    if checksum.native_subrow_bytes:
        firsts, dst_firsts, lengths = zip(*paired_runs(piece.src_block_ids, piece.dst_block_ids))
        rows = range(pages.shape[1] * layers.start, pages.shape[1] * layers.stop)
        segments = native.segments(rows, dst_pages.shape[2], dst_firsts, rows, pages.shape[2], firsts, lengths,
                                   pages.shape[-1])
        return checksum.copy_native(dst_pages, pages, segments)
    sums, src_pages, dst_pages = [], pages[layers], dst_pages[layers]
    for src, dst, n in paired_runs(piece.src_block_ids, piece.dst_block_ids):
        np.copyto(dst_pages[:, :, dst : dst + n], src_pages[:, :, src : src + n])
        sums.append(checksum.block_sums(kv_cache, layers, src, n))  # the source run, still hot
    checksum.add_block_sums(torch.cat(sums, dim=2))


def write_piece_on_device(kernels: Kernels, kv_cache: torch.Tensor, dst_cache: torch.Tensor, piece: Piece,
                          checksum: KVChecksum) -> None:
    """P, cuda_ipc: gather the piece on P's device (checksummed there), scatter it into the receiver's cache
    (``dst_cache``, opened from its IPC handle; on another GPU the packed piece crosses once, peer to peer where
    the GPUs allow it), and return once every byte is in place, so ``Written`` may follow."""
    layers = piece.layers
    packed = kernels.pack_kv_blocks(kv_cache, torch.tensor(piece.src_block_ids, dtype=torch.int64), layers)
    checksum.update_packed(packed)
    dst_ids = torch.tensor(piece.dst_block_ids, dtype=torch.int64, device=dst_cache.device)
    dst_cache[layers].index_copy_(2, dst_ids, packed.to(dst_cache.device))
    synchronize(kv_cache.device, dst_cache.device)


def land_piece(
    kernels: Kernels, kv_cache: torch.Tensor, pages: np.ndarray | None, dst_block_ids: list[int], layers: slice,
    frame: memoryview | None, checksum: KVChecksum,
) -> None:
    """D: copy ``frame`` (zmq; its size already checked) into ``dst_block_ids`` and checksum what lands (in
    the same pass natively, else from the cache right after), or checksum the bytes P wrote there (shm)."""
    num_layers, n = layers.stop - layers.start, len(dst_block_ids)
    if pages is not None and checksum.native_subrow_bytes:
        indexes, firsts, lengths = zip(*runs(dst_block_ids))
        rows = range(pages.shape[1] * layers.start, pages.shape[1] * layers.stop)
        if frame is None:  # shm: read what P wrote
            segments = native.segments(rows, pages.shape[2], firsts, rows, pages.shape[2], firsts, lengths,
                                       pages.shape[-1])
            return checksum.copy_native(None, pages, segments)
        segments = native.segments(rows, pages.shape[2], firsts, range(len(rows)), n, indexes, lengths,
                                   pages.shape[-1])
        return checksum.copy_native(pages, frame, segments)
    if frame is None:
        return checksum.update_blocks(kv_cache, dst_block_ids, layers)
    if pages is None:
        # [num_layers, pages_per_layer, n, page_size, num_kv_heads, head_dim], a view of ZMQ's receive buffer
        packed = torch.frombuffer(frame, dtype=torch.uint8).view(kv_cache.dtype).view(
            num_layers, kv_cache.shape[1], n, *kv_cache.shape[3:])
        if isinstance(kv_cache, ShardedKVCache):  # the frame as it arrived, then each rank's heads into its shard
            checksum.update_packed(packed)
            return kv_cache.unpack(packed, dst_block_ids, layers)
        ids = torch.tensor(dst_block_ids, dtype=torch.int64)
        kernels.unpack_kv_blocks(packed.to(kv_cache.device), kv_cache, ids, layers)
        return checksum.update_blocks(kv_cache, dst_block_ids, layers)
    packed = np.frombuffer(frame, dtype=np.uint8).reshape(num_layers, pages.shape[1], n, pages.shape[-1])
    sums, dst_pages = [], pages[layers]
    for index, first, length in runs(dst_block_ids):
        np.copyto(dst_pages[:, :, first : first + length], packed[:, :, index : index + length])
        sums.append(checksum.block_sums(kv_cache, layers, first, length))  # what landed, still hot
    checksum.add_block_sums(torch.cat(sums, dim=2))
