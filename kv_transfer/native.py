"""The native copy-and-checksum (``kv_transfer._copysum``, built by setup.py) and the segment lists it takes.

One call moves a whole piece: every (layer, K/V) stretch of every run of blocks, reading each byte once
for both the copy and the checksum, with the GIL released and cache-bypassing stores into the
destination. Measured on 64 MiB of 32 KiB pages (docs/benchmarks.md, "KV transfer"): 10 ms against
22 ms for numpy's memcpy per run followed by the torch checksum, and 9.3 ms for one plain 64 MiB memcpy.
``copy_checksum`` is None where the extension could not be built (no C compiler); the data path then
falls back to numpy + torch, with the same bytes and the same checksum.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

try:
    from kv_transfer._copysum import copy_checksum
except ImportError:  # built without a C compiler: kv_transfer.data_path takes the numpy + torch path
    copy_checksum = None


def segments(
    dst_rows: range, dst_row_pages: int, dst_firsts: Sequence[int],
    src_rows: range, src_row_pages: int, src_firsts: Sequence[int], lengths: Sequence[int], page_bytes: int,
) -> np.ndarray:
    """``[len(rows) * len(runs), 3]`` int64 ``(dst_offset, src_offset, nbytes)``, rows outer, runs inner.

    Both buffers are ``[rows, row_pages, page_bytes]``; a row is one (layer, K/V) of a cache (row_pages =
    its number of blocks) or of a packed piece (row_pages = the piece's blocks). Run ``r`` copies
    ``lengths[r]`` pages from page ``src_firsts[r]`` of each source row to page ``dst_firsts[r]`` of the
    matching destination row. Rows outer, runs inner is the checksum's stream order.
    """
    runs = np.array((dst_firsts, src_firsts, lengths), dtype=np.int64).T  # [runs, 3]
    row_step = np.array((dst_row_pages, src_row_pages, 0), dtype=np.int64)
    first_row = np.array((dst_rows.start * dst_row_pages, src_rows.start * src_row_pages, 0), dtype=np.int64)
    out = np.arange(len(dst_rows), dtype=np.int64)[:, None, None] * row_step + (first_row + runs)
    out *= page_bytes
    return out.reshape(-1, 3)
