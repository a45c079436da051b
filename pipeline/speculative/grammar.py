"""Structured output under speculation: the masks a grammar-constrained request needs at each drafted
position, computed by walking its matcher along the drafts and rolling it back (the engine advances it
only by the tokens actually emitted)."""

from __future__ import annotations

import torch


def masks_along(matcher, drafts: list[int], vocab_size: int) -> torch.Tensor:
    """[len(drafts) + 1, ceil(vocab / 32)] packed int32: row j allows what the grammar allows after
    ``drafts[:j]``. Rows past a draft the grammar refuses, or past its completion, allow everything (the
    verify never reaches them: that draft is rejected, or the request stops there). ``matcher`` is left
    as it was found."""
    bitmask = torch.full((len(drafts) + 1, -(-vocab_size // 32)), -1, dtype=torch.int32)
    consumed = 0
    for j in range(len(drafts) + 1):
        if matcher.is_finished:
            break
        matcher.fill_bitmask(bitmask, j)
        if j == len(drafts) or not matcher.try_accept(drafts[j]):
            break
        consumed += 1
    if consumed:
        matcher.rollback(consumed)
    return bitmask


class DraftWalk:
    """The matchers of the speculating requests, advanced by each drafted token during the draft passes
    (so the draft proposes only what the grammar allows) and rolled back afterwards."""

    def __init__(self, matchers: list, vocab_size: int) -> None:
        self.matchers = matchers  # per speculating request, None without a grammar
        self.vocab_size = vocab_size
        self.consumed = [0] * len(matchers)
        self.is_broken = [False] * len(matchers)

    def mask(self, rows: list[int]) -> tuple[list[int], torch.Tensor] | None:
        """(positions in ``rows`` that have a live grammar, their packed masks) for the next draft token."""
        live = [local for local, i in enumerate(rows) if self._is_live(i)]
        if not live:
            return None
        bitmask = torch.empty(len(live), -(-self.vocab_size // 32), dtype=torch.int32)
        for row, local in enumerate(live):
            self.matchers[rows[local]].fill_bitmask(bitmask, row)
        return live, bitmask

    def advance(self, i: int, token_id: int) -> None:
        if self._is_live(i):
            if self.matchers[i].try_accept(token_id):
                self.consumed[i] += 1
            else:
                self.is_broken[i] = True

    def rollback(self) -> None:
        for matcher, consumed in zip(self.matchers, self.consumed):
            if consumed:
                matcher.rollback(consumed)

    def _is_live(self, i: int) -> bool:
        matcher = self.matchers[i]
        return matcher is not None and not self.is_broken[i] and not matcher.is_finished
