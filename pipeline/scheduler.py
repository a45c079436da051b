"""Scheduler: every batching and admission decision of a worker. Holds no tensors.

Request lifecycle (colocated PrefillAndDecode role):

1. ``add`` puts a new sequence at the back of the waiting queue (bounded by ``max_queue_size_tg``).
2. Each ``schedule`` call fills one step under a token budget of ``max_batch_input_tokens``:
   a. running sequences that decode first (one token each), then the next prompt chunk of
      running sequences whose prefill is still in progress (chunked prefill), oldest first — so a
      long prompt never stalls the decodes beside it (decode-first mixed batches); while prompts
      wait, a chunk takes at most ``long_prefill_token_threshold`` tokens (vLLM's name), so a short
      prompt is admitted into the same step as the long one before it, and the leftover budget
      returns to the chunks afterwards (no step is smaller for it); in a step that decodes, prompt
      chunks take at most ``max_prefill_tokens_beside_decodes`` tokens in all (a TPOT bound);
   b. a running sequence that needs a new KV block when the pool is empty preempts the most
      recently admitted running sequence (its blocks are freed; it goes back to the front of the
      waiting queue and is recomputed later from prompt + tokens generated so far);
   c. then waiting sequences, first come first served, while the batch has room
      (``max_batch_size``): admission reserves blocks for every known token at once, reusing
      prefix-cached blocks, and only while KV usage stays under ``kvcache_ce_watermark``.
   Under ``scheduling_policy = "priority"`` every queue is in (priority, arrival) order instead
   (``pipeline/scheduling_policy.py``): "oldest", "most recently admitted" and "first come" above
   read as "best" and "worst" by that key; fcfs is the default.
3. The model runs the step; ``update`` advances each scheduled sequence, publishes newly full
   blocks to the prefix cache and appends the sampled token to sequences whose chunk reached the
   end of their known tokens.
4. A finished or aborted sequence leaves the running list and frees its blocks at once, unless
   the caller keeps them (a PrefillOnly worker holds them until their KV has been shipped).

Prefix warm-ups (``add_warmup``, ``pipeline/prefix_warmup.py``): KV computed for the prefix cache only,
one at a time, in steps where nothing else runs; a warm-up gives way to any request that needs its
blocks or its batch row, and ends once its last full block is published (``register``).

Remote prefill (DecodeOnly role): ``add_remote`` queues a sequence whose prompt another worker
will prefill; ``reserve_remote`` admits it under the same watermark and batch-size rules by
reserving blocks for the prompt plus the first token (RESERVED); once its KV has arrived,
``activate_remote`` marks the prompt computed, appends the first token and makes it RUNNING.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pipeline.kv_cache import KVCacheManager
from pipeline.prefix_warmup import PrefixWarmups
from pipeline.scheduling_policy import QueueOrder, SchedulingPolicy
from pipeline.sequence import Sequence, SequenceStatus


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_queue_size_tg``; retry later."""


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first token position computed in this step
    num_tokens: int
    # speculative decoding: draft tokens a decode chunk verifies after its one known token (its KV
    # blocks are reserved for them; the step computes 1 + num_lookahead tokens)
    num_lookahead: int = 0

    @property
    def is_sampling(self) -> bool:
        """The chunk ends at the last known token, so its logits give the next token."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_batch_size: int,
        max_batch_input_tokens: int,
        enable_chunked_prefill: bool = True,
        kvcache_ce_watermark: float = 1.0,
        max_queue_size: int | None = None,
        long_prefill_token_threshold: int | None = None,
        max_prefill_tokens_beside_decodes: int | None = None,
        num_lookahead_tokens: int = 0,
        warmup_chunk_tokens: int = 32,
        scheduling_policy: SchedulingPolicy | str = SchedulingPolicy.FCFS,
    ) -> None:
        self.kv = kv_manager
        self.max_batch_size = max_batch_size
        self.max_batch_input_tokens = max_batch_input_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.kvcache_ce_watermark = kvcache_ce_watermark
        self.max_queue_size = max_queue_size
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_prefill_tokens_beside_decodes = max_prefill_tokens_beside_decodes
        self.num_lookahead_tokens = num_lookahead_tokens  # speculative decoding's K
        self.order = QueueOrder(scheduling_policy)  # where a sequence goes in each queue below
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.waiting_remote: deque[Sequence] = deque()
        self.reserved: dict[str, Sequence] = {}
        self.paused: dict[str, Sequence] = {}  # live migration: decoding stopped while their KV is handed off
        self.warmups = PrefixWarmups(kv_manager, warmup_chunk_tokens, max_usage=kvcache_ce_watermark)

    # -------------------------------------------------------------- requests
    def add(self, seq: Sequence) -> None:
        self._check_queue()
        seq.status = SequenceStatus.WAITING
        self.order.arrive(seq)
        self.order.push(self.waiting, seq)
        self.warmups.drop_covered(seq.token_ids)  # this request computes those blocks itself

    def add_remote(self, seq: Sequence) -> None:
        self._check_queue()
        seq.status = SequenceStatus.WAITING
        self.order.arrive(seq)
        self.order.push(self.waiting_remote, seq)

    def _check_queue(self) -> None:
        num_queued = len(self.waiting) + len(self.waiting_remote)
        if self.max_queue_size is not None and num_queued >= self.max_queue_size:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue_size} requests); retry later")

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None,
               keep_blocks: bool = False) -> None:
        """End ``seq`` wherever it is and release its blocks (unless ``keep_blocks``)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.RESERVED:
            del self.reserved[seq.request_id]
        elif seq.status is SequenceStatus.PAUSED:
            del self.paused[seq.request_id]
        elif seq.status is SequenceStatus.WAITING:
            (self.waiting_remote if seq in self.waiting_remote else self.waiting).remove(seq)
        if not keep_blocks:
            self.kv.free(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_remote) + len(self.reserved)

    # ---------------------------------------------------------- remote prefill
    def reserve_remote(self) -> list[Sequence]:
        """Admit queued remote-prefill sequences that fit; returns the newly reserved ones."""
        admitted: list[Sequence] = []
        while self.waiting_remote and self._num_committed_rows() < self.max_batch_size:
            seq = self.waiting_remote[0]
            # Room for the prompt and the first token, whose KV this worker computes in its first step
            # (a migrated stream holds its last token already: its KV is computed here next).
            num_slots = seq.num_tokens + (0 if seq.num_output_tokens else 1)
            num_cached = self.kv.allocate(seq.request_id, seq.token_ids, num_slots, max_usage=self.kvcache_ce_watermark)
            if num_cached is None and self.warmups.drop_active():  # its blocks go to real work first
                num_cached = self.kv.allocate(seq.request_id, seq.token_ids, num_slots,
                                              max_usage=self.kvcache_ce_watermark)
            if num_cached is None and not self.running and not self.reserved:
                # Nothing runs or waits for KV here, so nothing will free blocks: the whole pool rather than a
                # stall (a prompt between the watermark and the pool waited forever, and everything behind it)
                num_cached = self.kv.allocate(seq.request_id, seq.token_ids, num_slots)
            if num_cached is None:
                break
            self.waiting_remote.popleft()
            seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RESERVED
            self.reserved[seq.request_id] = seq
            admitted.append(seq)
        return admitted

    def activate_remote(self, seq: Sequence, first_token_id: int) -> None:
        """The prompt's KV has landed in the reserved blocks: decode from here on."""
        del self.reserved[seq.request_id]
        seq.num_computed_tokens = seq.num_draft_computed_tokens = seq.num_tokens  # the draft's KV came too
        self.kv.register_computed(seq.request_id, seq.token_ids, seq.num_computed_tokens)
        seq.append_token(first_token_id)
        seq.status = SequenceStatus.RUNNING
        self.order.push(self.running, seq)

    def activate_migrated(self, seq: Sequence, num_draft_computed_tokens: int | None) -> None:
        """A migrated stream's KV (every token but its last, already emitted) landed: decode from here on."""
        del self.reserved[seq.request_id]
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.num_draft_computed_tokens = min(seq.num_computed_tokens, num_draft_computed_tokens
                                            if num_draft_computed_tokens is not None else seq.num_computed_tokens)
        self.kv.register_computed(seq.request_id, seq.token_ids, seq.num_computed_tokens)
        seq.status = SequenceStatus.RUNNING
        self.order.push(self.running, seq)

    # --------------------------------------------------------- live migration
    def pause(self, seq: Sequence) -> None:
        """Stop scheduling a running ``seq``; it keeps its blocks (their KV is being handed off)."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PAUSED
        self.paused[seq.request_id] = seq

    def unpause(self, seq: Sequence) -> None:
        del self.paused[seq.request_id]
        seq.status = SequenceStatus.RUNNING
        self.order.push(self.running, seq)

    # ------------------------------------------------------------------- n > 1
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child``, a further choice of ``parent``'s request, once the parent's prompt KV is
        written: it shares the parent's full prompt blocks and computes only the rest of the prompt
        (less than a block, then its own first token). Without room in the pool or the batch it waits
        at the front of the queue (and is admitted like any request, reusing the prefix cache)."""
        child.priority, child.arrival = parent.priority, parent.arrival
        num_shared = None
        if self._num_committed_rows() < self.max_batch_size or self.warmups.drop_active():
            num_shared = self.kv.fork(parent.request_id, child.request_id, child.num_tokens)
        if num_shared is None:
            child.status = SequenceStatus.WAITING
            self.order.push_back_waiting(self.waiting, child)
            return
        child.num_computed_tokens = child.num_draft_computed_tokens = child.num_cached_tokens = num_shared
        child.status = SequenceStatus.RUNNING
        self.order.push(self.running, child)

    # ---------------------------------------------------------- prefix warm-ups
    def add_warmup(self, seq: Sequence) -> None:
        """Queue a prefix warm-up (``pipeline/prefix_warmup.py``); it holds no blocks until it runs."""
        self.warmups.add(seq)

    @property
    def has_warmups(self) -> bool:
        return len(self.warmups) > 0

    def _num_rows(self) -> int:
        """Rows of the persistent batch in use: the running requests and the running warm-up."""
        return len(self.running) + (self.warmups.active is not None)

    def _num_committed_rows(self) -> int:
        """Rows in use and rows promised: a reserved request runs as soon as its KV lands, and a paused one
        again if its handoff is declined, neither of them admitted again. A request is admitted only under
        ``max_batch_size`` of these, so the batch never outgrows its rows (the persistent batch has no more)."""
        return self._num_rows() + len(self.reserved) + len(self.paused)

    @property
    def num_queued_prefill_tokens(self) -> int:
        """Prompt tokens waiting to run (warm-ups not: they give way to every prompt)."""
        return sum(s.num_tokens - s.num_computed_tokens for s in self.waiting)

    # -------------------------------------------------------------- planning
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_batch_input_tokens
        # Decode-first: every running sequence that needs one token runs before any prefill chunk, so
        # a long prompt is spread over steps beside the decodes instead of stalling them.
        # A sequence at its length limit is not run again: its last token (still being read, overlap
        # pipeline) finishes it.
        decoding = [s for s in self.running
                    if s.num_tokens - s.num_computed_tokens == 1 and s.num_tokens < s.max_total_tokens]
        for seq in decoding:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted by an earlier sequence of this step
            lookahead = self._lookahead(seq, budget)
            if not self._reserve(seq, seq.num_computed_tokens + 1 + lookahead, out):
                break  # ``seq`` itself was preempted: nothing after it can run either
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1, lookahead))
            budget -= 1 + lookahead
        # Then prompts already in progress, oldest first (their blocks were reserved at admission),
        # then admissions. While prompts wait, each chunk takes at most ``long_prefill_token_threshold``
        # tokens, so a short prompt behind a long one shares the step instead of waiting out the long
        # prompt's every chunk; what is left of the budget then goes back to the chunks, oldest first.
        if out.chunks and self.enable_chunked_prefill and self.max_prefill_tokens_beside_decodes is not None:
            budget = min(budget, self.max_prefill_tokens_beside_decodes)  # the decodes' next tokens wait on it
        cap = budget
        if self.waiting and self.enable_chunked_prefill and self.long_prefill_token_threshold is not None:
            cap = self.long_prefill_token_threshold
        num_decodes = len(out.chunks)
        for seq in list(self.running):
            num_left = seq.num_tokens - seq.num_computed_tokens
            if budget <= 0 or out.preempted:
                break
            if num_left <= 1:
                continue
            num_new = min(num_left, budget, cap)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
        if not out.preempted:
            budget = self._admit_waiting(out, budget, cap)
        for chunk in out.chunks[num_decodes:]:  # prompt chunks only: a decode is one token by nature
            if budget <= 0:
                break
            extra = min(budget, chunk.seq.num_tokens - chunk.start - chunk.num_tokens)
            chunk.num_tokens += extra
            budget -= extra
        if not out.chunks and not self.waiting and not out.preempted:  # an idle step: warm-ups may run
            chunk = self.warmups.next_chunk(has_row=self._num_committed_rows() < self.max_batch_size)
            if chunk is not None:
                out.chunks.append(ScheduledChunk(*chunk))
        return out

    def _lookahead(self, seq: Sequence, budget: int) -> int:
        """Draft tokens ``seq`` verifies this step: K, fewer near its length limit (a step emits at most
        lookahead + 1 tokens) or when the step's budget is short; none for requests that do not speculate."""
        if not self.num_lookahead_tokens or not seq.speculates:
            return 0
        return max(0, min(self.num_lookahead_tokens, seq.max_total_tokens - seq.num_tokens - 1, budget - 1))

    def _reserve(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Grow ``seq``'s blocks to ``num_tokens``, preempting from the back of the running list (the latest
        admitted, or under priority the worst: the decodes run best first, so none scheduled before is hit)."""
        while not self.kv.ensure_capacity(seq.request_id, num_tokens):
            if self.warmups.drop_active():
                continue
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.num_draft_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.order.push_back_waiting(self.waiting, seq)
        out.preempted.append(seq)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, cap: int) -> int:
        while self.waiting and budget > 0 and (self._num_committed_rows() < self.max_batch_size
                                                or self.warmups.drop_active()):
            seq = self.waiting[0]
            # a request asking for prompt logprobs computes every prompt position: no prefix reuse
            known = seq.token_ids if seq.prompt_logprobs is None else []
            num_cached = self.kv.allocate(seq.request_id, known, seq.num_tokens, max_usage=self.kvcache_ce_watermark)
            if num_cached is None and self.warmups.drop_active():  # its blocks go to real work first
                num_cached = self.kv.allocate(seq.request_id, known, seq.num_tokens,
                                              max_usage=self.kvcache_ce_watermark)
            if num_cached is None and not self.running:
                # Nothing runs, so nothing will free blocks: let it use the whole pool rather than stall.
                num_cached = self.kv.allocate(seq.request_id, known, seq.num_tokens)
            if num_cached is None:
                break
            num_new = seq.num_tokens - num_cached
            if not self.enable_chunked_prefill and num_new > budget:
                self.kv.free(seq.request_id)
                break
            self.waiting.popleft()
            seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
            seq.num_computed_tokens = seq.num_draft_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.order.push(self.running, seq)
            num_new = min(num_new, budget, cap)
            out.chunks.append(ScheduledChunk(seq, num_cached, num_new))
            budget -= num_new
        return budget

    # ---------------------------------------------------------------- results
    def update(self, out: SchedulerOutput, sampled_token_ids: list[int], register: bool = True) -> list[Sequence]:
        """Advance the step's sequences; returns the sequences that got a new token, in chunk order.

        ``sampled_token_ids`` has one entry per sampling chunk, in chunk order (placeholders when the
        overlap pipeline advances lengths at launch; it then calls ``register`` once the values are known).
        """
        sampled = iter(sampled_token_ids)
        advanced: list[Sequence] = []
        for chunk in out.chunks:
            seq = chunk.seq
            is_sampling = chunk.is_sampling  # read before the token is appended
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            if is_sampling:
                seq.append_token(next(sampled))
                advanced.append(seq)
        if register:
            self.register(out)
        return advanced

    def register(self, out: SchedulerOutput) -> None:
        """Publish the blocks the step filled to the prefix cache (its input tokens must all be known);
        sequences preempted or finished since hold no blocks to publish."""
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.status is SequenceStatus.RUNNING:
                self.kv.register_computed(seq.request_id, seq.token_ids, chunk.start + chunk.num_tokens)
                if seq.is_warmup:
                    self.warmups.on_published(seq, chunk.start + chunk.num_tokens)
