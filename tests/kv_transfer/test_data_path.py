"""The data path moves exactly the requested pages, and both ends' checksums agree whichever way the
bytes moved: the native copy-and-checksum or memcpy per run of blocks (CPU caches), the kernels (other
devices), or in place (shm). Every test runs once with the native extension and once without it."""

from __future__ import annotations

import pytest
import torch

from kernels import load_kernels
from kv_transfer import native
from kv_transfer.blocks import split_pieces
from kv_transfer.checksum import KVChecksum
from kv_transfer.data_path import PackBuffers, byte_pages, land_piece, pack_piece, write_piece_in_place
from tests.kv_transfer.helpers import random_cache

KERNELS = load_kernels("torch")
SRC_IDS = [5, 6, 7, 0, 9, 2, 3]  # runs of consecutive blocks and lone ones
DST_IDS = [1, 2, 3, 8, 4, 10, 11]  # some runs line up with the source's, some do not


@pytest.fixture(autouse=True, params=["native", "numpy"])
def cpu_copy(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(native, "copy_checksum", None)
    else:
        assert native.copy_checksum is not None, "kv_transfer._copysum is not built (setup.py needs a C compiler)"
    return request.param


def _pieces(cache: torch.Tensor) -> tuple[list, int]:
    page_bytes = cache[0, 0, 0].numel() * cache.element_size()
    layer_block_bytes = cache.shape[1] * page_bytes  # K and V pages, or one latent page
    block_bytes = cache.shape[0] * layer_block_bytes
    return split_pieces(0, cache.shape[0], SRC_IDS, DST_IDS, layer_block_bytes, max_bytes=3 * block_bytes), page_bytes


def _assert_landed(dst: torch.Tensor, src: torch.Tensor) -> None:
    assert torch.equal(dst[:, :, DST_IDS], src[:, :, SRC_IDS])
    untouched = [b for b in range(dst.shape[2]) if b not in DST_IDS]
    assert torch.count_nonzero(dst[:, :, untouched]) == 0


# K/V pages, and a latent cache (multi-head latent attention: one page of latent rows per layer and block)
CACHE_SHAPES = {"kv": (3, 2, 12, 4, 2, 8), "latent": (3, 1, 12, 4, 1, 24)}


@pytest.mark.parametrize("kind", CACHE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_path_moves_the_same_bytes_with_the_same_checksum(dtype, kind):
    src = random_cache(CACHE_SHAPES[kind], dtype, seed=7)
    pieces, page_bytes = _pieces(src)
    assert len(pieces) == 3
    streams = {}
    for path, src_pages in (("memcpy", byte_pages(src)), ("kernels", None)):
        sent, landed = KVChecksum(page_bytes), KVChecksum(page_bytes)
        frames = [pack_piece(KERNELS, src, src_pages, piece, sent, PackBuffers(1, 0))[0] for piece in pieces]
        dst = torch.zeros_like(src)
        dst_pages = byte_pages(dst) if src_pages is not None else None
        for piece, frame in zip(pieces, frames):
            land_piece(KERNELS, dst, dst_pages, piece.dst_block_ids, piece.layers, memoryview(frame), landed)
        _assert_landed(dst, src)
        assert (sent.value, sent.num_bytes) == (landed.value, landed.num_bytes)
        streams[path] = (b"".join(frame.tobytes() for frame in frames), sent.value)
    assert streams["memcpy"] == streams["kernels"]

    dst = torch.zeros_like(src)  # shm: the sender writes in place, the receiver only verifies
    written, verified = KVChecksum(page_bytes), KVChecksum(page_bytes)
    for piece in pieces:
        write_piece_in_place(src, byte_pages(src), byte_pages(dst), piece, written)
        land_piece(KERNELS, dst, byte_pages(dst), piece.dst_block_ids, piece.layers, None, verified)
    _assert_landed(dst, src)
    assert written.value == verified.value == streams["memcpy"][1]


def test_a_page_landing_in_the_wrong_block_changes_the_checksum():
    src = random_cache((2, 2, 12, 4, 2, 8), torch.float16, seed=8)
    pieces, page_bytes = _pieces(src)
    sent, landed = KVChecksum(page_bytes), KVChecksum(page_bytes)
    dst = torch.zeros_like(src)
    for piece in pieces:
        packed, _ = pack_piece(KERNELS, src, byte_pages(src), piece, sent, PackBuffers(1, 0))
        land_piece(KERNELS, dst, byte_pages(dst), piece.dst_block_ids, piece.layers, memoryview(packed), landed)
    assert sent.value == landed.value
    dst[1, 0, DST_IDS[2]] = dst[1, 0, DST_IDS[1]]  # one page overwritten by its neighbour in the stream
    again = KVChecksum(page_bytes)
    for piece in pieces:
        again.update_blocks(dst, piece.dst_block_ids, piece.layers)
    assert again.value != sent.value


def test_pack_buffers_are_reused_only_once_zmq_released_them():
    class Tracker:
        done = False

    buffers, tracker = PackBuffers(buffer_bytes=64, max_free=1), Tracker()
    first = buffers.take(10)
    assert first.nbytes == 64
    buffers.lend(first, tracker)
    second = buffers.take(10)
    assert second is not first  # still on the wire
    tracker.done = True
    assert buffers.take(64) is first and buffers.take(100).nbytes == 100
