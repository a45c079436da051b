"""SequenceBuffer: the persistent batch, one row per running request, kept across steps (EasyDeL's name).

Rebuilding a step's inputs from Python lists costs per-token Python work every step: the input ids,
positions and KV slots of each token, and a padded block table per request. This buffer keeps, for
each request while it runs, a row of its token ids and a row of its block table in NumPy arrays. A
step then only writes what changed since the last one (a decode writes one token; a block is added
every ``page_size`` tokens), and ``gather`` builds the whole flat batch with a few vectorized
indexing operations.

Rows are added when a request is first scheduled, and removed when it finishes, is aborted or is
preempted (a preempted request comes back with new blocks, so it gets a new row). ``remove_request``
then ``condense`` the rows: the last row moves into the gap, so the active rows stay at
``[0, num_reqs)``. Only the model runner touches the buffer, on the host thread.

The overlap pipeline appends placeholders (``PLACEHOLDER_TOKEN_ID``) for tokens still being computed.
The buffer copies them like any token, remembers where they are, and rewrites those positions once
the host knows their values, so a request recomputed later never reads a stale placeholder.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.forward_batch import flat_token_layout
from pipeline.sampling_metadata import SamplingArrays
from pipeline.sequence import PLACEHOLDER_TOKEN_ID, Sequence


@dataclass
class GatheredInputs:
    """One step's flat inputs as NumPy arrays (the runner moves them to the device)."""

    input_ids: np.ndarray  # [num_tokens] int64; PLACEHOLDER_TOKEN_ID where the previous step's token goes
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    cu_seqlens: np.ndarray  # [num_seqs + 1] int32
    context_lens: np.ndarray  # [num_seqs] int32
    block_tables: np.ndarray  # [num_seqs, max_blocks_in_batch] int32
    token_chunk: np.ndarray  # [num_tokens] int64: which chunk (sequence of the batch) each token belongs to


class SequenceBuffer:
    def __init__(self, max_num_reqs: int, max_model_len: int, page_size: int, vocab_size: int = 2**31 - 1) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.page_size = page_size
        self.vocab_size = vocab_size
        max_blocks = -(-max_model_len // page_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
        # the dense sampling parameters, one entry per row, written once when a request gets its row
        empty = SamplingArrays.from_states([], vocab_size)
        self.sampling = {name: np.zeros(max_num_reqs, dtype=getattr(empty, name).dtype)
                         for name in SamplingArrays.FIELDS}
        # Per-row bookkeeping read every step for every row: Python lists (a NumPy scalar read costs more)
        self.num_tokens = [0] * max_num_reqs  # tokens of each row copied so far
        self.num_blocks = [0] * max_num_reqs
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self._index: dict[str, int] = {}
        self._placeholders: list[list[int]] = [[] for _ in range(max_num_reqs)]  # positions still unknown
        # (sequence object, its preemption count) each row was filled for: a request id reused by a new
        # request, or a request preempted and readmitted with new blocks, starts its row over
        self._owners: list[tuple[Sequence, int] | None] = [None] * max_num_reqs

    @property
    def num_reqs(self) -> int:
        return len(self._index)

    def row_of(self, request_id: str) -> int | None:
        return self._index.get(request_id)

    # ------------------------------------------------------------ rows
    def add_request(self, request_id: str) -> int:
        """A new, empty row at the end for ``request_id``; its tokens and blocks come with ``sync``."""
        if request_id in self._index:
            raise ValueError(f"request {request_id!r} already has row {self._index[request_id]}")
        row = self.num_reqs
        if row >= self.max_num_reqs:
            raise RuntimeError(f"the sequence buffer is full ({self.max_num_reqs} rows)")
        self._index[request_id] = row
        self.req_ids[row] = request_id
        self._reset(row)
        return row

    def _reset(self, row: int) -> None:
        self.num_tokens[row] = 0
        self.num_blocks[row] = 0
        self.block_table[row] = 0  # padding past a row's blocks reads block 0, never a stale id
        self._placeholders[row] = []
        self._owners[row] = None

    def remove_request(self, request_id: str) -> int | None:
        """Free ``request_id``'s row (None if it has none); ``condense`` closes the gap."""
        row = self._index.pop(request_id, None)
        if row is not None:
            self.req_ids[row] = None
            self._owners[row] = None
        return row

    def condense(self, empty_rows: list[int]) -> None:
        """Move the last active rows into ``empty_rows`` so the active rows are ``[0, num_reqs)``."""
        for empty in sorted(empty_rows):
            last = self._last_active_row()
            if last is None or last < empty:
                continue  # the gap is already past every active row
            self.swap_states(empty, last)

    def swap_states(self, i1: int, i2: int) -> None:
        """Exchange everything two rows hold (tokens, blocks, sampling parameters, bookkeeping)."""
        if i1 == i2:
            return
        for array in (self.token_ids, self.block_table, *self.sampling.values()):
            array[[i1, i2]] = array[[i2, i1]]
        for values in (self.num_tokens, self.num_blocks, self._placeholders, self._owners, self.req_ids):
            values[i1], values[i2] = values[i2], values[i1]
        for row in (i1, i2):
            if self.req_ids[row] is not None:
                self._index[self.req_ids[row]] = row

    def _last_active_row(self) -> int | None:
        for row in range(len(self.req_ids) - 1, -1, -1):
            if self.req_ids[row] is not None:
                return row
        return None

    # ------------------------------------------------------------ steps
    def sync(self, seq: Sequence, block_ids: list[int]) -> int:
        """Bring one request's row up to date; see ``sync_all``."""
        return self.sync_all([seq], [block_ids])[0]

    def sync_all(self, seqs: list[Sequence], tables: list[list[int]]) -> list[int]:
        """Bring each request's row up to date (adding rows for new ones): tokens appended or learned
        since the last step, blocks allocated since. Returns the rows, in order.

        A decode adds one token and now and then one block: those single writes are collected and
        made with one NumPy assignment each, so a step costs a few integer comparisons per request."""
        index, owners, num_tokens, num_blocks = self._index, self._owners, self.num_tokens, self.num_blocks
        token_rows, token_positions, token_values = [], [], []
        block_rows, block_positions, block_values = [], [], []
        rows = []
        for seq, table in zip(seqs, tables):
            row = index.get(seq.request_id)
            if row is None:
                row = self.add_request(seq.request_id)
            owner = owners[row]
            if owner is None or owner[0] is not seq or owner[1] != seq.num_preemptions:
                self._take_row(row, seq)
            tokens = seq.token_ids
            if self._placeholders[row]:
                self._learn_placeholders(row, tokens)
            copied, total = num_tokens[row], len(tokens)
            if copied + 1 == total:
                token_rows.append(row)
                token_positions.append(copied)
                token_values.append(tokens[copied])
                if tokens[copied] == PLACEHOLDER_TOKEN_ID:
                    self._placeholders[row].append(copied)
            elif copied < total:
                new = tokens[copied:]
                self.token_ids[row, copied:total] = new
                if PLACEHOLDER_TOKEN_ID in new:
                    self._placeholders[row] += [copied + i for i, t in enumerate(new) if t == PLACEHOLDER_TOKEN_ID]
            num_tokens[row] = total
            have, need = num_blocks[row], len(table)
            if have + 1 == need:
                block_rows.append(row)
                block_positions.append(have)
                block_values.append(table[have])
            elif have < need:
                self.block_table[row, have:need] = table[have:]
            num_blocks[row] = need
            rows.append(row)
        if token_rows:
            self.token_ids[token_rows, token_positions] = token_values
        if block_rows:
            self.block_table[block_rows, block_positions] = block_values
        return rows

    def _take_row(self, row: int, seq: Sequence) -> None:
        """``row`` now belongs to ``seq``: start it over and write its sampling parameters."""
        self._reset(row)
        self._owners[row] = (seq, seq.num_preemptions)
        if seq.sampling_state is not None:
            values = SamplingArrays.row_values(seq.sampling_state, self.vocab_size)
            for name, value in zip(SamplingArrays.FIELDS, values):
                self.sampling[name][row] = value

    def _learn_placeholders(self, row: int, tokens: list[int]) -> None:
        """Rewrite the placeholders whose values the host has learned since the last step."""
        pending = self._placeholders[row]
        for position in pending:
            if tokens[position] != PLACEHOLDER_TOKEN_ID:
                self.token_ids[row, position] = tokens[position]
        self._placeholders[row] = [p for p in pending if tokens[p] == PLACEHOLDER_TOKEN_ID]

    def sampling_arrays(self, rows: list[int]) -> SamplingArrays:
        """The dense sampling parameters of ``rows`` (the sampled rows of a step, in order)."""
        index = np.asarray(rows, dtype=np.int64)
        return SamplingArrays(**{name: array[index] for name, array in self.sampling.items()})

    def gather(self, rows: list[int], starts: list[int], lengths: list[int]) -> GatheredInputs:
        """The flat batch of chunk ``i`` = tokens ``[starts[i], starts[i] + lengths[i])`` of row ``rows[i]``."""
        rows_a = np.asarray(rows, dtype=np.int64)
        starts_a = np.asarray(starts, dtype=np.int64)
        num_chunks = len(rows)
        if max(lengths) == 1:  # a decode-only step: one token per row
            token_chunk = np.arange(num_chunks, dtype=np.int64)
            positions, token_rows = starts_a, rows_a
            cu_seqlens = np.arange(num_chunks + 1, dtype=np.int32)
            context_lens = starts_a + 1
        else:
            token_chunk, positions, cu_seqlens, context_lens = flat_token_layout(
                starts_a, np.asarray(lengths, dtype=np.int64))
            token_rows = rows_a[token_chunk]
        page_size = self.page_size
        slot_mapping = self.block_table[token_rows, positions // page_size].astype(np.int64) * page_size \
            + positions % page_size
        width = max(self.num_blocks[row] for row in rows)
        return GatheredInputs(
            input_ids=self.token_ids[token_rows, positions].astype(np.int64),
            positions=positions,
            slot_mapping=slot_mapping,
            cu_seqlens=cu_seqlens,
            context_lens=context_lens.astype(np.int32),
            block_tables=self.block_table[rows_a, :width],
            token_chunk=token_chunk,
        )
