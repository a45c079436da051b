"""Block descriptors: argument checks, runs of consecutive blocks, and splitting a send into pieces."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pipeline.protocol.transfer import KVLayout

# A piece is what travels as one frame (zmq) or one in-place copy (shm). Bounded so that packing the next
# piece overlaps sending this one, and so that one request cannot hold the I/O thread for long.
MAX_PIECE_BYTES = 4 << 20


@dataclass(frozen=True)
class Piece:
    """Blocks ``src[i] -> dst[i]`` of layers ``[layer_start, layer_stop)`` of one request."""

    layer_start: int
    layer_stop: int
    src_block_ids: list[int]
    dst_block_ids: list[int]

    @property
    def layers(self) -> slice:
        return slice(self.layer_start, self.layer_stop)

    def num_bytes(self, layer_block_bytes: int) -> int:
        """Bytes of the piece, given ``KVLayout.layer_block_bytes`` (one block of one layer)."""
        return (self.layer_stop - self.layer_start) * len(self.dst_block_ids) * layer_block_bytes


def normalize_layers(layers: slice | int | None, num_layers: int) -> tuple[int, int]:
    """``None`` = all layers, an int = that layer, a slice with step 1 = that range."""
    if layers is None:
        return 0, num_layers
    if isinstance(layers, int):
        if not 0 <= layers < num_layers:
            raise ValueError(f"layers: {layers} is out of range [0, {num_layers})")
        return layers, layers + 1
    if isinstance(layers, slice):
        start, stop, step = layers.indices(num_layers)
        if step != 1 or stop <= start:
            raise ValueError(f"layers: must be a non-empty slice with step 1 (got {layers})")
        return start, stop
    raise TypeError(f"layers: must be None, an int or a slice (got {type(layers).__name__})")


def normalize_block_ids(block_ids: Sequence[int] | torch.Tensor, num_blocks: int, name: str) -> list[int]:
    ids = block_ids.tolist() if isinstance(block_ids, torch.Tensor) else [int(b) for b in block_ids]
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{name}: ids {bad[:8]} are out of range [0, {num_blocks})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name}: ids must be distinct")
    return ids


def runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(index, first_block, length)`` for each maximal run of consecutive ids."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if out and out[-1][1] + out[-1][2] == b:
            index, first, length = out[-1]
            out[-1] = (index, first, length + 1)
        else:
            out.append((i, b, 1))
    return out


def paired_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_first, dst_first, length)`` for each maximal run consecutive on both sides."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def split_pieces(
    layer_start: int, layer_stop: int, src: list[int], dst: list[int], layer_block_bytes: int,
    max_bytes: int = MAX_PIECE_BYTES,
) -> list[Piece]:
    """Split one send into pieces of at most ``max_bytes`` (at least one page pair each).

    Pieces keep every requested layer and take a range of blocks, so each block of a piece is one
    large strided region (cheap to copy and checksum); only when one block over all requested layers
    is too big do pieces go layer by layer.
    """
    if not dst:
        return []
    num_layers = layer_stop - layer_start
    block_bytes = num_layers * layer_block_bytes  # one block over the requested layers
    if block_bytes <= max_bytes:
        step = max_bytes // block_bytes
        return [Piece(layer_start, layer_stop, src[i : i + step], dst[i : i + step]) for i in range(0, len(dst), step)]
    step = max(1, max_bytes // layer_block_bytes)
    return [
        Piece(layer, layer + 1, src[i : i + step], dst[i : i + step])
        for layer in range(layer_start, layer_stop)
        for i in range(0, len(dst), step)
    ]


def check_piece(layout: KVLayout, allowed: set[int], header, frame_bytes: int | None) -> str | None:
    """Why the piece ``header`` (a ``Blocks`` with a data frame of ``frame_bytes``, or a ``Written``: None)
    must not land in a reservation of the ``allowed`` blocks; None when it may."""
    start, stop, ids = header.layer_start, header.layer_stop, header.dst_block_ids
    if not 0 <= start < stop <= layout.num_layers:
        return f"bad piece: layers [{start}, {stop}) outside [0, {layout.num_layers})"
    outside = [b for b in ids if b not in allowed]
    if not ids or outside or len(set(ids)) != len(ids):
        return f"bad piece: blocks must be distinct and reserved (outside: {outside[:8]}, count {len(ids)})"
    expected = layout.kv_bytes(len(ids), stop - start)
    if header.num_bytes != expected:
        return f"size mismatch: piece header announces {header.num_bytes} bytes, its blocks hold {expected}"
    if frame_bytes is not None and frame_bytes != expected:
        return f"size mismatch: piece header announces {expected} bytes, frame has {frame_bytes}"
    return None
