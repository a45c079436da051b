"""Request checksum: a position-weighted sum of 64-bit words over the KV byte stream, torch-vectorized.

The stream of a request is the concatenation of its pieces, each in packed order
``[layer][K/V][block][page bytes]`` (exactly what ``pack_kv_blocks`` produces). The stream is cut into
sub-rows of 2 KiB (or the largest divisor of a page below that), each sub-row is summed as int64 words
mod 2**64, and sub-row ``j`` is weighted by the odd constant ``(2j + 1) * 0x9E3779B97F4A7C15``; the
checksum is the weighted total plus a multiple of the byte count, mod 2**64. Both ends compute it over
their own KV cache: the sender over its source blocks, the receiver over its destination blocks, either
in the pass that lands the bytes there (zmq on the CPU: ``copy_native``, which reads each byte once for
the copy and the sum) or by reading them back (shm, where the sender wrote them; other devices).
So it checks the data path end to end, on CPU or GPU, with no host copy.

What it catches: every corruption confined to one word (8 bytes for any page size that allows it;
any bit flips in it: an odd weight is invertible mod 2**64); pages or sub-rows that landed in the
wrong block, layer or K/V slot, were duplicated, or never arrived (their weights differ); a missing or
extra piece (byte count and weights shift). What it does not: a permutation of words inside one 2 KiB
sub-row, and deliberately cancelling edits (it is not a cryptographic hash). The torch path is one read
of the data, run by run right after that run was copied, with the weighting as one small reduction per
request (``value``); the native path (``kv_transfer.native``) weights as it goes and gives the same value.
"""

from __future__ import annotations

import math

import torch

from kv_transfer import native
from kv_transfer.blocks import runs

_MASK = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # golden-ratio constant as a signed int64
_SUBROW_BYTES = 2048
_MAX_PENDING = 1 << 20  # sub-row sums held before weighting (8 MiB; 2 GiB of KV)
_WORD_DTYPES = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1))
_WORD_SIZES = dict(_WORD_DTYPES)


class KVChecksum:
    """Running checksum of one request; feed pieces in stream order, read ``value`` at the end."""

    def __init__(self, page_bytes: int) -> None:
        self._word_dtype, word_size = next((d, s) for d, s in _WORD_DTYPES if page_bytes % s == 0)
        words_per_page = page_bytes // word_size
        self._subrow_words = math.gcd(words_per_page, max(1, _SUBROW_BYTES // word_size))
        self._subrows_per_page = words_per_page // self._subrow_words
        self._acc = 0
        self._num_subrows = 0
        self._pending: list[torch.Tensor] = []  # sub-row sums not yet weighted: one reduction per request
        self._num_pending = 0
        self._weights: torch.Tensor | None = None
        self._words_of: tuple[torch.Tensor, slice, torch.Tensor] | None = None
        self.num_bytes = 0

    @property
    def value(self) -> int:
        """The uint64 checksum of everything fed so far."""
        self._flush()
        return (self._acc + self.num_bytes * _MIX) & _MASK

    @property
    def native_subrow_bytes(self) -> int | None:
        """The sub-row size ``copy_native`` works in; None when it cannot (no extension, or pages that are
        not a whole number of 64-bit words)."""
        if native.copy_checksum is None or self._word_dtype != torch.int64:
            return None
        return self._subrow_words * 8

    def copy_native(self, dst, src, segments, stream: bool = True) -> None:
        """Copy ``segments`` (``native.segments``, in stream order) from buffer ``src`` to ``dst`` (None:
        read only) and add what was read, in the same pass (``native_subrow_bytes`` must not be None)."""
        self._flush()
        subrow_bytes = self.native_subrow_bytes
        weighted, num = native.copy_checksum(dst, src, segments, subrow_bytes, self._num_subrows, stream)
        self._acc = (self._acc + _MIX * weighted) & _MASK
        self._num_subrows += num
        self.num_bytes += num * subrow_bytes

    def update_packed(self, packed: torch.Tensor) -> None:
        """Add a packed piece ``[layers, 2, n, page_size, num_kv_heads, head_dim]`` (contiguous)."""
        words = packed.reshape(-1).view(torch.uint8).view(self._word_dtype).view(-1, self._subrow_words)
        self._defer(self._sum(words))
        self.num_bytes += packed.numel() * packed.element_size()

    def update_blocks(self, kv_cache: torch.Tensor, block_ids: list[int], layers: slice) -> None:
        """Add the piece ``pack_kv_blocks(kv_cache, block_ids, layers)`` would give, without packing it."""
        sums = [self.block_sums(kv_cache, layers, first, length) for _, first, length in runs(block_ids)]
        self.add_block_sums(torch.cat(sums, dim=2))

    def block_sums(self, kv_cache: torch.Tensor, layers: slice, first: int, length: int) -> torch.Tensor:
        """Sub-row sums of blocks ``first .. first + length - 1``: ``[num_selected_layers, 2, length,
        subrows_per_page]``. Callers that copy those blocks call it right after the copy, while they are hot."""
        return self._sum(self._layer_words(kv_cache, layers).narrow(2, first, length))

    def _layer_words(self, kv_cache: torch.Tensor, layers: slice) -> torch.Tensor:
        """``[num_selected_layers, 2, num_blocks, subrows_per_page, subrow_words]`` over kv_cache's memory,
        memoized: a piece asks once per run of blocks, with the same cache and layers."""
        memo = self._words_of
        if memo is None or memo[0] is not kv_cache or memo[1] != layers:
            num_layers, pages_per_layer, num_blocks = kv_cache.shape[:3]  # 2 (K, V) or 1 (latent) pages per layer
            start, stop, _ = layers.indices(num_layers)
            words = (
                kv_cache.view(torch.uint8)
                .view(num_layers, pages_per_layer, num_blocks, -1)
                .view(self._word_dtype)
                .view(num_layers, pages_per_layer, num_blocks, self._subrows_per_page, self._subrow_words)
                .narrow(0, start, stop - start)
            )
            memo = self._words_of = (kv_cache, layers, words)
        return memo[2]

    def add_block_sums(self, sums: torch.Tensor) -> None:
        """Add a piece given as ``block_sums`` concatenated along the block axis, in packed order."""
        self._defer(sums.reshape(-1))
        self.num_bytes += sums.numel() * self._subrow_words * _WORD_SIZES[self._word_dtype]

    def _sum(self, words: torch.Tensor) -> torch.Tensor:
        # int64 sums wrap mod 2**64 on CPU and GPU alike, so the order of the reduction does not matter.
        return words.sum(-1) if self._word_dtype == torch.int64 else words.sum(-1, dtype=torch.int64)

    def _defer(self, subrow_sums: torch.Tensor) -> None:  # [m] int64, next in stream order
        self._pending.append(subrow_sums)
        self._num_pending += subrow_sums.numel()
        if self._num_pending >= _MAX_PENDING:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._add(torch.cat(self._pending) if len(self._pending) > 1 else self._pending[0])
            self._pending, self._num_pending = [], 0

    def _add(self, subrow_sums: torch.Tensor) -> None:  # [m] int64
        # sum_j s_j * (2 * (offset + j) + 1) * MIX  ==  MIX * (sum_j s_j * (2j + 1) + 2 * offset * sum_j s_j)
        num = subrow_sums.numel()
        odd = self._odd_weights(num, subrow_sums.device)
        weighted, total = torch.stack([(subrow_sums * odd).sum(), subrow_sums.sum()]).tolist()
        self._acc = (self._acc + _MIX * (weighted + 2 * self._num_subrows * total)) & _MASK
        self._num_subrows += num

    def _odd_weights(self, num: int, device: torch.device) -> torch.Tensor:  # [num] int64: 1, 3, 5, ...
        cached = self._weights
        if cached is None or cached.numel() < num or cached.device != device:
            cached = self._weights = torch.arange(1, 2 * max(num, 1024), 2, dtype=torch.int64, device=device)
        return cached[:num]
