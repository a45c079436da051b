"""Paged KV block manager: the single owner of block bookkeeping. Pure Python, no tensors.

Blocks hold ``page_size`` tokens each. A sequence owns an ordered list of block ids (its block
table). Full blocks whose KV has been computed are registered under a content hash chained over the
prefix (``hash(parent_hash, tokens)``), so a later sequence with the same prefix reuses them (ref
counts). A block whose ref count drops to 0 goes back to the free queue but keeps its hash until it
is handed out again: prefix-cached blocks that no live request holds count as free.

A sequence's last, partly filled block is kept too when it ends (a *partial tail*: the tokens whose
KV it holds, under the hash of the full blocks before it). A chat's next turn repeats the previous
turn's whole text, so its prompt begins with those tokens; the next sequence whose prompt continues
the same full blocks with them takes that block over and computes only the rest (nobody else can have
it: it is written on from there). Without this, up to ``page_size - 1`` tokens of every turn are
computed again. Partial tails are never published (the router's index counts full blocks only).

With ``record_events`` the manager also keeps what changed in its prefix cache since the last
``drain_events`` (hashes published, hashes forgotten): a worker reports them to the router, whose
index then knows which prompts each worker can reuse (``router.kv_index``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field


def hash_block(parent_hash: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Stable (cross-process) hash of one full block given the hash of the prefix before it."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash or b"root")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


_ROOT = b"root"  # the parent hash of a sequence's first block


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    content_hash: bytes | None = None
    # free and kept as a partial tail: the parent hash it continues and the tokens whose KV it holds
    partial_parent: bytes | None = None
    partial_token_ids: tuple[int, ...] = ()


@dataclass
class _SequenceBlocks:
    block_ids: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks already registered in the prefix cache
    last_hash: bytes | None = None
    tail_token_ids: tuple[int, ...] = ()  # the tokens with KV in block ``num_hashed_blocks`` (not full)
    is_withheld: bool = False  # its blocks past those published by now never enter the prefix cache


class KVCacheManager:
    def __init__(self, num_blocks: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or page_size < 1:
            raise ValueError(f"num_blocks and page_size must be >= 1 (got {num_blocks}, {page_size})")
        self.num_total_blocks = num_blocks
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self._cached: dict[bytes, int] = {}  # content hash -> block id
        self._partials: dict[bytes, int] = {}  # parent hash -> the free block kept as its partial tail
        self._sequences: dict[str, _SequenceBlocks] = {}
        self._events: dict[bytes, bool] | None = None  # hash -> cached now (True) or forgotten (False)

    # ----------------------------------------------------------------- events
    def record_events(self) -> None:
        """From now on keep the prefix cache's changes for ``drain_events``."""
        if self._events is None:
            self._events = {}

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """(hashes now cached, hashes forgotten) since the last drain: each hash once, in its latest state."""
        events = self._events
        if not events:  # the common pass of a worker's loop: nothing changed, nothing allocated
            return [], []
        self._events = {}
        stored = [h for h, cached in events.items() if cached]
        return stored, [h for h, cached in events.items() if not cached]

    def cached_hashes(self) -> list[bytes]:
        """Every hash the prefix cache holds now (a snapshot for the router's index)."""
        return list(self._cached)

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks no live sequence holds (prefix-cached ones included: they are evictable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def block_table(self, seq_id: str) -> list[int]:
        return self._sequences[seq_id].block_ids

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._sequences

    def find_cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids of the longest cached prefix of ``token_ids``, leaving at least one token uncached
        (the last prompt token must run through the model to produce logits)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent: bytes | None = None
        max_blocks = (len(token_ids) - 1) // self.page_size
        for i in range(max_blocks):
            parent = hash_block(parent, token_ids[i * self.page_size : (i + 1) * self.page_size])
            block_id = self._cached.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, token_ids: list[int], num_tokens: int, max_usage: float = 1.0) -> bool:
        """Whether ``allocate`` would succeed with usage after it at most ``max_usage``."""
        hits = self.find_cached_prefix(token_ids)
        return self._num_blocks_after(hits, num_tokens) <= self._budget(max_usage)

    # --------------------------------------------------------------- mutations
    def allocate(self, seq_id: str, token_ids: list[int], num_tokens: int, max_usage: float = 1.0) -> int | None:
        """Reserve blocks for ``num_tokens`` tokens of a new sequence whose known tokens are ``token_ids``.

        Returns the number of leading tokens whose KV is already cached (full blocks, then the tokens of a
        partial tail it took over), or None (and changes nothing) when the pool cannot hold it under
        ``max_usage``.
        """
        if seq_id in self._sequences:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        hits = self.find_cached_prefix(token_ids)
        last_hash = self._blocks[hits[-1]].content_hash if hits else None
        tail, num_tail_tokens = self._find_partial_tail(token_ids, len(hits), last_hash)
        reused = hits + [tail.block_id] if num_tail_tokens else hits
        if self._num_blocks_after(reused, num_tokens) > self._budget(max_usage):
            return None
        seq = _SequenceBlocks()
        for block_id in reused:
            self._take(block_id)
            seq.block_ids.append(block_id)
        if num_tail_tokens:
            self._drop_partial(tail)
        seq.num_hashed_blocks = len(hits)
        seq.last_hash = last_hash
        self._sequences[seq_id] = seq
        self._grow(seq, self.num_blocks_for(num_tokens))
        return len(hits) * self.page_size + num_tail_tokens

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> int | None:
        """Give ``child_id`` the parent's KV of its first ``num_tokens`` tokens (a prompt both share):
        the full blocks before the last of those tokens are shared (ref counts), the rest are fresh
        blocks the child computes itself (its own partial block: nothing it writes lands in a block the
        parent reads). Returns the number of shared tokens, or None (no change) when the pool is short."""
        if child_id in self._sequences:
            raise ValueError(f"sequence {child_id!r} already holds blocks")
        parent = self._sequences[parent_id]
        num_shared = min((num_tokens - 1) // self.page_size, len(parent.block_ids))
        if self.num_blocks_for(num_tokens) - num_shared > len(self._free):
            return None
        child = _SequenceBlocks()  # hashes are recomputed from its tokens when it registers blocks
        for block_id in parent.block_ids[:num_shared]:
            self._take(block_id)
            child.block_ids.append(block_id)
        child.is_withheld = parent.is_withheld  # it shares the parent's blocks: their KV is as incomplete
        self._sequences[child_id] = child
        self._grow(child, self.num_blocks_for(num_tokens))
        return num_shared * self.page_size

    def ensure_capacity(self, seq_id: str, num_tokens: int) -> bool:
        """Grow ``seq_id``'s block table to hold ``num_tokens`` tokens; False (no change) if the pool is short."""
        seq = self._sequences[seq_id]
        needed = self.num_blocks_for(num_tokens) - len(seq.block_ids)
        if needed > len(self._free):
            return False
        self._grow(seq, self.num_blocks_for(num_tokens))
        return True

    def withhold(self, seq_id: str) -> None:
        """Keep ``seq_id``'s blocks not published yet out of the prefix cache for good, and keep no partial tail
        of it: some hold no valid KV in every layer (a sliding-window layer's blocks outside its window, never
        sent by a prefill worker). Published hashes chain, so nothing after the first such block could be reused."""
        self._sequences[seq_id].is_withheld = True

    def register_computed(self, seq_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Publish the full blocks among the first ``num_computed_tokens`` (KV written) to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        seq = self._sequences[seq_id]
        if seq.is_withheld:
            return
        num_full = min(num_computed_tokens // self.page_size, len(seq.block_ids))
        for i in range(seq.num_hashed_blocks, num_full):
            content_hash = hash_block(seq.last_hash, token_ids[i * self.page_size : (i + 1) * self.page_size])
            block = self._blocks[seq.block_ids[i]]
            if content_hash not in self._cached:
                block.content_hash = content_hash
                self._cached[content_hash] = block.block_id
                if self._events is not None:
                    self._events[content_hash] = True
            seq.last_hash = content_hash
            seq.num_hashed_blocks = i + 1
        start = seq.num_hashed_blocks * self.page_size
        has_tail = seq.num_hashed_blocks == num_full < len(seq.block_ids) and num_computed_tokens > start
        seq.tail_token_ids = tuple(token_ids[start:num_computed_tokens]) if has_tail else ()

    def free(self, seq_id: str) -> None:
        """Release every block ``seq_id`` holds. Unknown ids are ignored (free is idempotent)."""
        seq = self._sequences.pop(seq_id, None)
        if seq is None:
            return
        # Tail blocks first so that the LRU evicts the end of a prefix before its start.
        for block_id in reversed(seq.block_ids):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        if seq.tail_token_ids:  # (only recorded with prefix caching on)
            self._keep_partial(self._blocks[seq.block_ids[seq.num_hashed_blocks]], seq.last_hash or _ROOT,
                               seq.tail_token_ids)

    def reset_prefix_cache(self) -> None:
        for block_id in self._free:
            self._forget(self._blocks[block_id])

    # ----------------------------------------------------------- partial tails
    def _find_partial_tail(self, token_ids: list[int], num_hits: int,
                           last_hash: bytes | None) -> tuple[_Block | None, int]:
        """(block, tokens): the partial tail kept after the ``num_hits`` cached full blocks of ``token_ids``,
        and how many of its leading tokens ``token_ids`` shares (0: none). The last token stays uncached,
        as with full blocks."""
        block_id = self._partials.get(last_hash or _ROOT)
        if block_id is None:
            return None, 0
        tail = self._blocks[block_id]
        wanted = token_ids[num_hits * self.page_size:len(token_ids) - 1]
        num_shared = 0
        for mine, theirs in zip(wanted, tail.partial_token_ids):
            if mine != theirs:
                break
            num_shared += 1
        return tail, num_shared

    def _keep_partial(self, block: _Block, parent: bytes, token_ids: tuple[int, ...]) -> None:
        """A sequence ended with ``token_ids`` written in ``block``, its last (not full, never shared) one;
        the newest tail under a parent replaces the one kept before."""
        previous = self._partials.get(parent)
        if previous is not None:
            self._drop_partial(self._blocks[previous])
        self._partials[parent] = block.block_id
        block.partial_parent, block.partial_token_ids = parent, token_ids

    def _drop_partial(self, block: _Block) -> None:
        if block.partial_parent is not None and self._partials.get(block.partial_parent) == block.block_id:
            del self._partials[block.partial_parent]
        block.partial_parent, block.partial_token_ids = None, ()

    # ---------------------------------------------------------------- helpers
    def _budget(self, max_usage: float) -> int:
        """How many blocks may be in use at most."""
        return int(max_usage * self.num_total_blocks + 1e-9)

    def _num_blocks_after(self, hits: list[int], num_tokens: int) -> int:
        num_new = max(self.num_blocks_for(num_tokens) - len(hits), 0)
        num_revived = sum(1 for b in hits if self._blocks[b].ref_count == 0)
        if num_new > len(self._free) - num_revived:
            return self.num_total_blocks + 1  # impossible whatever the budget
        return self.num_used_blocks + num_revived + num_new

    def _take(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _grow(self, seq: _SequenceBlocks, num_blocks: int) -> None:
        while len(seq.block_ids) < num_blocks:
            block_id, _ = self._free.popitem(last=False)
            block = self._blocks[block_id]
            self._forget(block)
            block.ref_count = 1
            seq.block_ids.append(block_id)

    def _forget(self, block: _Block) -> None:
        self._drop_partial(block)
        if block.content_hash is not None and self._cached.get(block.content_hash) == block.block_id:
            del self._cached[block.content_hash]
            if self._events is not None:
                self._events[block.content_hash] = False
        block.content_hash = None
