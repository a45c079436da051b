"""The native copy-and-checksum against numpy and the torch checksum: same bytes, same value, for any
alignment and stream/cached stores, and clear errors instead of out-of-bounds access."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_transfer import native
from kv_transfer.checksum import KVChecksum

pytestmark = pytest.mark.skipif(native.copy_checksum is None, reason="kv_transfer._copysum not built")

PAGE = 256  # bytes; sub-rows of 256 bytes (the checksum's rule for this page size)


def _torch_checksum(data: np.ndarray) -> int:
    checksum = KVChecksum(PAGE)
    checksum.update_packed(torch.from_numpy(data.copy()))
    return checksum.value


@pytest.mark.parametrize("offset", [0, 8, 24])
@pytest.mark.parametrize("stream", [True, False])
def test_copy_matches_numpy_and_the_torch_checksum(offset, stream):
    rng = np.random.default_rng(offset)
    src = rng.integers(0, 256, size=10 * PAGE + offset, dtype=np.uint8)[offset:]
    dst = np.zeros(12 * PAGE + offset, dtype=np.uint8)[offset:]
    pages = [7, 2, 3, 9]  # src page -> dst page i + 1, in this order
    segments = np.array([((i + 1) * PAGE, p * PAGE, PAGE) for i, p in enumerate(pages)], dtype=np.int64)
    checksum = KVChecksum(PAGE)
    checksum.copy_native(dst, src, segments, stream=stream)
    expected = np.concatenate([src[p * PAGE : (p + 1) * PAGE] for p in pages])
    assert np.array_equal(dst[PAGE : 5 * PAGE], expected)
    assert not dst[:PAGE].any() and not dst[5 * PAGE :].any()
    assert (checksum.value, checksum.num_bytes) == (_torch_checksum(expected), len(expected))

    read_only = KVChecksum(PAGE)
    read_only.copy_native(None, dst, np.array([(0, PAGE, 4 * PAGE)], dtype=np.int64))
    assert read_only.value == checksum.value


def test_pieces_continue_the_stream_like_one_call():
    src = np.random.default_rng(1).integers(0, 256, size=8 * PAGE, dtype=np.uint8)
    whole, parts = KVChecksum(PAGE), KVChecksum(PAGE)
    whole.copy_native(None, src, np.array([(0, 0, 8 * PAGE)], dtype=np.int64))
    for first in range(0, 8, 3):
        n = min(3, 8 - first)
        parts.copy_native(None, src, np.array([(0, first * PAGE, n * PAGE)], dtype=np.int64))
    assert whole.value == parts.value == _torch_checksum(src)


def test_segments_are_stream_ordered_offsets():
    got = native.segments(range(2), 3, [0, 2], range(4, 6), 10, [5, 1], [2, 1], page_bytes=4)
    # rows outer, runs inner: (dst row 0: pages 0, 2; dst row 1: pages 3, 5) <- (src row 4 / 5)
    assert got.tolist() == [[0, 180, 8], [8, 164, 4], [12, 220, 8], [20, 204, 4]]


@pytest.mark.parametrize(
    "segment, message",
    [((0, 4 * PAGE, 2 * PAGE), "outside"), ((3 * PAGE, 0, 2 * PAGE), "outside"), ((0, -PAGE, PAGE), "outside"),
     ((0, 0, 100), "sub-rows"), ((0, 0, -PAGE), "sub-rows")],
)
def test_bad_segments_are_refused_before_any_byte_moves(segment, message):
    src, dst = np.ones(5 * PAGE, dtype=np.uint8), np.zeros(4 * PAGE, dtype=np.uint8)
    with pytest.raises(ValueError, match=message):
        native.copy_checksum(dst, src, np.array([(0, 0, PAGE), segment], dtype=np.int64), PAGE, 0)
    assert not dst.any()


def test_read_only_destination_and_bad_arguments_are_refused():
    src, segments = np.ones(PAGE, dtype=np.uint8), np.array([(0, 0, PAGE)], dtype=np.int64)
    with pytest.raises(BufferError):
        native.copy_checksum(bytes(PAGE), src, segments, PAGE, 0)
    with pytest.raises(ValueError, match="multiple of 8"):
        native.copy_checksum(None, src, segments, 12, 0)
    with pytest.raises(ValueError, match="triples"):
        native.copy_checksum(None, src, np.zeros(4, dtype=np.int64), PAGE, 0)
    with pytest.raises(ValueError, match="triples"):
        native.copy_checksum(None, src, segments.astype(np.float64), PAGE, 0)
