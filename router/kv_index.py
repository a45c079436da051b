"""Where every KV block lives: the router's index of the prefix-cache blocks each worker holds.

Workers report the content hashes of the blocks they publish to and evict from their prefix cache
(``KVEvents``, on their ordered link to the router; a full snapshot after every registration), so the
index holds exactly what each worker's cache can reuse. A worker that dies or registers again (a new
process starts with an empty cache) is forgotten at once. Memory is bounded by the workers' own block
counts: a worker's entry never holds more hashes than it has blocks (a report claiming more is cut).

The hashes are ``pipeline.kv_cache.hash_block`` chained over the prompt, per page size, so the router
can ask "how many leading blocks of this prompt does worker W hold" without any tensor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pipeline.kv_cache import hash_block

logger = logging.getLogger(__name__)


@dataclass
class _WorkerBlocks:
    page_size: int
    capacity: int  # the worker's total blocks: its cache can never hold more
    hashes: set[bytes] = field(default_factory=set)
    next_seq: int = 0  # the sequence number the next batch must carry


class KVIndex:
    def __init__(self) -> None:
        self._workers: dict[str, _WorkerBlocks] = {}

    def register(self, worker_id: str, page_size: int, num_total_blocks: int) -> None:
        """A (re)registered worker starts from an empty cache until its snapshot arrives."""
        self._workers[worker_id] = _WorkerBlocks(page_size, max(0, num_total_blocks))

    def forget(self, worker_id: str) -> None:
        """The worker died or left: none of its blocks can be reused any more."""
        self._workers.pop(worker_id, None)

    def apply(self, worker_id: str, seq: int, stored: list[bytes], removed: list[bytes], full: bool) -> bool:
        """One batch of a worker's events; False when it cannot be applied (unknown worker, or a gap in
        the sequence: then the worker's entry is emptied, and the worker is asked for a snapshot)."""
        entry = self._workers.get(worker_id)
        if entry is None:
            return False
        if full:
            entry.hashes = set()
        elif seq != entry.next_seq:
            logger.warning("KV events from %s: expected batch %d, got %d; index emptied until a snapshot",
                           worker_id, entry.next_seq, seq)
            entry.hashes = set()
            return False
        entry.next_seq = seq + 1
        entry.hashes.difference_update(removed)
        room = entry.capacity - len(entry.hashes)
        if len(stored) > room:
            logger.warning("KV events from %s claim more blocks than it has (%d); extra ignored", worker_id,
                           entry.capacity)
            stored = stored[:max(room, 0)]
        entry.hashes.update(stored)
        return True

    def num_blocks(self, worker_id: str) -> int:
        entry = self._workers.get(worker_id)
        return len(entry.hashes) if entry is not None else 0

    def page_size(self, worker_id: str) -> int | None:
        entry = self._workers.get(worker_id)
        return entry.page_size if entry is not None else None

    def cached_prefix_tokens(self, worker_id: str, prompt: "PromptHashes") -> int:
        """How many leading prompt tokens the worker's cache holds (a multiple of its page size)."""
        entry = self._workers.get(worker_id)
        if entry is None or not entry.hashes:
            return 0
        num_blocks = 0
        for block_hash in prompt.hashes(entry.page_size):
            if block_hash not in entry.hashes:
                break
            num_blocks += 1
        return num_blocks * entry.page_size


class PromptHashes:
    """A prompt's chained block hashes per page size, computed once per page size it is asked for.

    As a worker's cache does, the last prompt token is never counted as cached (it must run to give logits)."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self._by_page_size: dict[int, list[bytes]] = {}

    def hashes(self, page_size: int) -> list[bytes]:
        cached = self._by_page_size.get(page_size)
        if cached is None:
            cached, parent = [], None
            for i in range((len(self.token_ids) - 1) // page_size):
                parent = hash_block(parent, self.token_ids[i * page_size:(i + 1) * page_size])
                cached.append(parent)
            self._by_page_size[page_size] = cached
        return cached
