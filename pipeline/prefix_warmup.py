"""Prefix warm-ups: KV computed in idle steps for tokens a worker expects to see again.

Why: after a disaggregated turn ends, its decode worker holds the whole conversation, but the prefill
worker that computed the prompt never saw the answer. The conversation's next turn would make that
prefill worker recompute the answer on the critical path, before the new message. The router instead
asks it, as the turn ends, to warm its prefix cache with prompt + answer (``WarmPrefix``); the next
turn then computes only the new message there, and sends the decode worker only the blocks it lacks.
(The router also has prefill workers warm a prefix that conversations share, a system prompt, when
they lack it: ``router.policy.popular_prefix_gaps``.)

How a warm-up runs (the scheduler decides when, ``PrefixWarmups`` keeps the queue and its blocks):

1. ``warmup_tokens`` keeps the full blocks of the tokens, plus one token that is never computed, so
   no chunk of a warm-up reaches its end and nothing is ever sampled for it.
2. Queued warm-ups are bounded (the oldest give way) and hold no blocks. One at a time is admitted,
   and only in a step with nothing else to run: no waiting prompt, no running chunk. Its chunks take at
   most ``chunk_tokens``, so a request that arrives meanwhile waits for one short chunk at most. A
   warm-up only extends what the cache holds: one whose cached prefix was evicted while it waited is
   dropped (the pool is short; recomputing a whole conversation in the background would evict more).
3. A warm-up gives way to real work: it is dropped when a request needs its blocks or its batch row,
   and when a new prompt repeats its tokens (that request computes them itself).
4. Its full blocks are published to the prefix cache step by step, like a prompt's; once the last one
   is published it ends and frees its blocks, which stay cached (evictable) for the next turn.
"""

from __future__ import annotations

from collections import deque

from pipeline.kv_cache import KVCacheManager
from pipeline.sequence import Sequence, SequenceStatus

# Beyond this the oldest queued warm-up is dropped: a worker with that much deferred work is busy, and the
# oldest conversation's next turn is the likeliest to have come (and computed its own prefix) already.
MAX_QUEUED_WARMUPS = 16


def warmup_tokens(token_ids: list[int], page_size: int) -> list[int] | None:
    """The tokens a warm-up of ``token_ids`` holds: its full blocks and one more that is never computed
    (None when not one full block would be computed)."""
    num_full = len(token_ids) // page_size * page_size
    if num_full == 0:
        return None
    return list(token_ids[:num_full]) + [token_ids[num_full - 1]]


class PrefixWarmups:
    """Warm-ups waiting (no blocks yet) and the one running (``active``, holding blocks in ``kv``)."""

    def __init__(self, kv: KVCacheManager, chunk_tokens: int, max_usage: float = 1.0,
                 max_queued: int = MAX_QUEUED_WARMUPS) -> None:
        self.kv = kv
        self.chunk_tokens = max(1, chunk_tokens)
        self.max_usage = max_usage
        self.max_queued = max_queued
        self.queued: deque[Sequence] = deque()
        self.active: Sequence | None = None
        self.finished: list[Sequence] = []  # ended or dropped since the last ``take_finished``
        self.num_dropped = 0

    def __len__(self) -> int:
        return len(self.queued) + (self.active is not None)

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` (``num_cached_tokens``: what it must still find cached when it runs)."""
        seq.is_warmup = True
        seq.status = SequenceStatus.WAITING
        self.queued.append(seq)
        while len(self.queued) > self.max_queued:
            self._drop(self.queued.popleft())

    def plan(self, token_ids: list[int], num_computed_here: int = 0) -> tuple[list[int], int] | None:
        """(``warmup_tokens``, leading tokens cached now) of a warm-up worth queueing for ``token_ids``; None
        when the prefix cache is off, holds them all already, no longer holds the ``num_computed_here``
        leading tokens this worker computed itself (evicted: the pool is short), or a queued or running
        warm-up computes them already (a shared prefix asked for twice)."""
        page_size = self.kv.page_size
        tokens = warmup_tokens(token_ids, page_size) if self.kv.enable_prefix_caching else None
        if tokens is None:
            return None
        num_full = len(tokens) - 1
        num_cached = len(self.kv.find_cached_prefix(tokens)) * page_size
        if num_cached >= num_full or num_cached < min(num_computed_here, num_full) // page_size * page_size:
            return None
        if any(seq.num_tokens - 1 >= num_full and seq.token_ids[:num_full] == tokens[:num_full] for seq in self._all()):
            return None
        return tokens, num_cached

    # ------------------------------------------------------------ running
    def next_chunk(self, has_row: bool) -> tuple[Sequence, int, int] | None:
        """(sequence, start, num_tokens) of the next warm-up chunk, admitting a queued warm-up (if
        ``has_row``: a free batch row) when none runs; None when there is nothing to compute."""
        while self.active is None and self.queued and has_row:
            self._admit(self.queued.popleft())
        seq = self.active
        if seq is None:
            return None
        num_new = min(self.chunk_tokens, seq.num_tokens - 1 - seq.num_computed_tokens)
        return (seq, seq.num_computed_tokens, num_new) if num_new > 0 else None

    def on_published(self, seq: Sequence, num_tokens: int) -> None:
        """The first ``num_tokens`` of ``seq``'s KV are published: it ends once that covers its last full block."""
        if seq is self.active and num_tokens >= seq.num_tokens - 1:
            self._end(seq)

    def end_if_complete(self) -> None:
        """For a caller that publishes blocks itself and knows the running warm-up's progress is written."""
        if self.active is not None:
            self.on_published(self.active, self.active.num_computed_tokens)

    def drop_active(self) -> bool:
        """Free the running warm-up's blocks and batch row for real work; False when none runs."""
        if self.active is None:
            return False
        self._end(self.active, dropped=True)
        return True

    def drop_covered(self, token_ids: list[int]) -> None:
        """A request with prompt ``token_ids`` computes the blocks of every warm-up whose full blocks lead it."""
        for seq in [s for s in self._all() if len(token_ids) > s.num_tokens - 1
                    and token_ids[:s.num_tokens - 1] == s.token_ids[:s.num_tokens - 1]]:
            if seq is self.active:
                self._end(seq, dropped=True)
            else:
                self.queued.remove(seq)
                self._drop(seq)

    def take_finished(self) -> list[Sequence]:
        finished, self.finished = self.finished, []
        return finished

    # ------------------------------------------------------------ helpers
    def _admit(self, seq: Sequence) -> None:
        num_cached = self.kv.allocate(seq.request_id, seq.token_ids, seq.num_tokens, max_usage=self.max_usage)
        if num_cached is None:  # the pool is in use: a warm-up never waits for (or takes) live requests' room
            self._drop(seq)
            return
        if num_cached < seq.num_cached_tokens:  # evicted while it waited (see the module docstring, 2.)
            self.kv.free(seq.request_id)
            self._drop(seq)
            return
        seq.num_computed_tokens = seq.num_draft_computed_tokens = seq.num_cached_tokens = num_cached
        seq.status = SequenceStatus.RUNNING
        self.active = seq
        self.on_published(seq, num_cached)  # the prefix cache may have held all of it already

    def _end(self, seq: Sequence, dropped: bool = False) -> None:
        self.kv.free(seq.request_id)  # its published blocks stay in the prefix cache
        seq.status = SequenceStatus.FINISHED
        if self.active is seq:
            self.active = None
        self._drop(seq) if dropped else self.finished.append(seq)

    def _drop(self, seq: Sequence) -> None:
        self.num_dropped += 1
        seq.status = SequenceStatus.FINISHED
        self.finished.append(seq)

    def _all(self) -> list[Sequence]:
        return [*self.queued, *([self.active] if self.active is not None else [])]
