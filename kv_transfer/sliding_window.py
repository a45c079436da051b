"""Which blocks of a transfer each layer needs: a sliding-window layer only those its sink can still attend to.

The paged attention lets a query at position ``q`` of a layer with window ``W`` see the keys at positions
``q - W + 1 .. q`` (``k_pos > q_pos - W``; the triton kernel starts reading at ``q - W + 1`` too). The sink
computes its first query at ``first_query_position`` and every later one after it, so a sliding layer needs
only the blocks from ``(first_query_position - W + 1) // page_size`` on (rounded out to the whole block that
holds that key); a full layer (window 0) needs every block. The earlier blocks of a sliding layer are never
sent: the sink holds no valid KV there, so it keeps that request's blocks out of its prefix cache
(``KVSink`` asks the engine to withhold them) -- a later prompt sharing the prefix must not read them.

Both halves plan from the same ``PrefillRequest`` and ``KVLayout``: the source sends what ``plan_sends`` says,
the sink expects exactly ``planned_bytes`` and the checksum covers the same pieces in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pipeline.protocol.cluster import PrefillRequest
from pipeline.protocol.transfer import KVLayout


@dataclass(frozen=True)
class LayerSend:
    """Blocks ``[block_start, block_stop)`` (indexes into the request's block tables) of layers
    ``[layer_start, layer_stop)``."""

    layer_start: int
    layer_stop: int
    block_start: int
    block_stop: int

    @property
    def layers(self) -> slice:
        return slice(self.layer_start, self.layer_stop)

    @property
    def num_layer_blocks(self) -> int:
        return (self.layer_stop - self.layer_start) * (self.block_stop - self.block_start)


def num_kv_tokens(request: PrefillRequest) -> int:
    """Tokens whose KV the source sends: the prompt, or a migrated stream's tokens but its last (which the
    sink computes in its next step)."""
    return len(request.prompt_token_ids) - (1 if request.source_request_id is not None else 0)


def first_query_position(request: PrefillRequest, page_size: int) -> int:
    """The earliest position the sink computes a query at once the KV arrived: the next token's, or, for a
    request of several choices, the start of the block holding the last sent token (each further choice
    shares only the full blocks before it and computes the rest of the prompt itself: ``KVCacheManager.fork``)."""
    num_tokens = num_kv_tokens(request)
    if request.sampling_params.num_sequences > 1:
        return max(num_tokens - 1, 0) // page_size * page_size
    return num_tokens


def first_needed_block(window: int, page_size: int, first_query: int) -> int:
    """The first block a layer of ``window`` (0: full attention) needs for queries from ``first_query`` on."""
    if not window:
        return 0
    return max(first_query - window + 1, 0) // page_size


def plan_sends(windows: Sequence[int], page_size: int, first_query: int, block_start: int,
               block_stop: int) -> list[LayerSend]:
    """The sends that ship blocks ``[block_start, block_stop)`` of every layer that needs them, block ranges in
    order and, within one, runs of consecutive layers (all layers at once where every layer needs the blocks)."""
    firsts = [first_needed_block(window, page_size, first_query) for window in windows]
    cuts = sorted({block_start, block_stop, *(f for f in firsts if block_start < f < block_stop)})
    sends: list[LayerSend] = []
    for lo, hi in zip(cuts, cuts[1:]):
        layer = 0
        while layer < len(firsts):
            if firsts[layer] > lo:
                layer += 1
                continue
            start = layer
            while layer < len(firsts) and firsts[layer] <= lo:
                layer += 1
            sends.append(LayerSend(start, layer, lo, hi))
    return sends


def plan_request(layout: KVLayout, request: PrefillRequest, block_start: int, block_stop: int) -> list[LayerSend]:
    """``plan_sends`` for ``request`` under ``layout`` (its windows and page size)."""
    return plan_sends(layout.attention_windows, layout.page_size, first_query_position(request, layout.page_size),
                      block_start, block_stop)


def num_blocks_sent(request: PrefillRequest, page_size: int) -> int:
    """The blocks a whole transfer of ``request`` covers (partial last block included), skipped ones too."""
    return min(-(-num_kv_tokens(request) // page_size), len(request.dst_block_ids))


def planned_bytes(layout: KVLayout, request: PrefillRequest) -> int:
    """The KV bytes the whole transfer of ``request`` moves: full layers x every block not cached at the sink,
    sliding layers x those of them inside their window, times one layer's block."""
    skipped = request.num_cached_tokens // layout.page_size
    sends = plan_request(layout, request, skipped, num_blocks_sent(request, layout.page_size))
    return sum(send.num_layer_blocks for send in sends) * layout.layer_block_bytes


def leaves_blocks_incomplete(layout: KVLayout, request: PrefillRequest) -> bool:
    """Whether some sliding layer's blocks between the sink's cached prefix and its window stay unsent (the
    sink then holds blocks without valid KV in that layer: they must never enter its prefix cache)."""
    skipped = request.num_cached_tokens // layout.page_size
    first_query = first_query_position(request, layout.page_size)
    stop = num_blocks_sent(request, layout.page_size)
    return any(min(first_needed_block(window, layout.page_size, first_query), stop) > skipped
               for window in layout.attention_windows)
