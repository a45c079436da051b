"""ForwardBatch: the flat, unpadded batch a model runs in one step.

Tokens of all scheduled sequences are concatenated (prefill chunks and decode tokens alike);
``cu_seqlens_q`` marks where each sequence's tokens start. The model runner builds it from the
scheduler's plan; models and kernels only read it.

Only the rows whose logits are sampled leave the last decoder layer: every layer before it must run
every row (their K/V feed the cache), but the last one's attention output, MLP and the final norm
are needed for the sampled rows alone. Where a step reads no other row (no prompt logprobs), its
batch carries ``final_layer`` (``with_final_layer_rows``): the last layer's batch, whose attention
takes only those rows' queries (``query_rows``), and the model returns ``[len(rows), hidden]`` (one
stand-in row where a step samples none: a long prompt's first chunks). In a prefill-heavy step that
is most of one layer's work skipped, with the same values on the rows that are kept.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, absolute position of each token in its sequence
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32, offsets of each sequence's query rows
    context_lens: torch.Tensor  # [num_seqs] int32, K/V length of each sequence after this step
    slot_mapping: torch.Tensor  # [num_tokens] int64, KV slot (block_id * page_size + offset) per token
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    logits_indices: torch.Tensor  # [num_sampled] int64, rows of the flat batch whose logits are needed
    # The last decoder layer's batch when only the sampled rows' outputs are read (None: every row leaves it)
    final_layer: ForwardBatch | None = None
    # [num_query_rows] int64: the rows whose attention outputs this batch computes, the last query rows of each of
    # its sequences (cu_seqlens_q, context_lens and block_tables then describe those rows); None: every row
    query_rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_seqs(self) -> int:
        return self.context_lens.numel()

    def of_layer(self, index: int, num_layers: int) -> ForwardBatch:
        """The batch layer ``index`` of ``num_layers`` runs: ``final_layer`` for the last one where there is one."""
        return self.final_layer if self.final_layer is not None and index == num_layers - 1 else self

    def kept_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ([num_tokens, ...]) at the rows whose attention outputs this batch computes."""
        return x if self.query_rows is None else x.index_select(0, self.query_rows)

    def sampled_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's output at the rows whose logits are needed: its first rows where only those (or, in a step that
        samples none, one stand-in row) left the last layer."""
        if self.final_layer is not None:
            return hidden[: self.logits_indices.numel()]
        return hidden[self.logits_indices]

    def to_arrays(self, base: ForwardBatch | None = None) -> dict:
        """Every tensor as a host array, for ``from_arrays`` in another process; ``final_layer`` as a nested dict of
        only the tensors it does not share with this batch (its token ids, positions and slots are this batch's)."""
        arrays = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None or (base is not None and value is getattr(base, field.name)):
                continue
            arrays[field.name] = value.to_arrays(base=self) if isinstance(value, ForwardBatch) else value.cpu().numpy()
        return arrays

    @classmethod
    def from_arrays(cls, arrays: dict, device, base: ForwardBatch | None = None) -> ForwardBatch:
        tensors = {name: torch.from_numpy(value).to(device) for name, value in arrays.items()
                   if not isinstance(value, dict)}
        batch = cls(**tensors) if base is None else dataclasses.replace(base, **tensors)
        if "final_layer" in arrays:  # shares this batch's tensors again
            batch = dataclasses.replace(batch, final_layer=cls.from_arrays(arrays["final_layer"], device, base=batch))
        return batch


def with_final_layer_rows(batch: ForwardBatch, cu_seqlens: np.ndarray, context_lens: np.ndarray,
                          block_tables: np.ndarray, logits_rows: np.ndarray, tensor) -> ForwardBatch:
    """``batch`` with a ``final_layer`` that runs only ``logits_rows`` (sorted flat rows, host arrays beside
    ``batch``'s own; ``tensor`` puts an array where ``batch`` lives; none: the first sequence's last row stands
    in). Unchanged where that would save nothing (every row is sampled) or cannot be expressed (some sequence's
    sampled rows are not its last rows)."""
    num_sampled = len(logits_rows)
    if num_sampled == int(cu_seqlens[-1]):
        return batch  # every row is sampled
    if num_sampled == 0:  # the step only fills the cache (a prompt's first chunks): one row stands in, so that no
        logits_rows = cu_seqlens[1:2].astype(np.int64) - 1  # kernel of the last layer sees an empty batch
        num_sampled = 1
    seq_of_row = np.searchsorted(cu_seqlens, logits_rows, side="right") - 1  # [num_sampled]
    seqs, counts = np.unique(seq_of_row, return_counts=True)
    first_kept = cu_seqlens[seqs + 1].astype(np.int64) - counts  # each sequence's last `count` rows start here
    rank_in_seq = np.arange(num_sampled) - np.repeat(np.cumsum(counts) - counts, counts)
    if not np.array_equal(logits_rows, np.repeat(first_kept, counts) + rank_in_seq):
        return batch  # some sequence's sampled rows are not its last rows: its attention could not start there
    kept_cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(counts, out=kept_cu[1:])
    final_layer = dataclasses.replace(
        batch, cu_seqlens_q=tensor(kept_cu), context_lens=tensor(np.ascontiguousarray(context_lens[seqs])),
        block_tables=tensor(np.ascontiguousarray(block_tables[seqs])), query_rows=tensor(logits_rows))
    return dataclasses.replace(batch, final_layer=final_layer)


def flat_token_layout(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, ...]:
    """Chunks of ``lengths[i]`` tokens starting at position ``starts[i]`` (int64 arrays), laid out flat:
    (chunk of each token [num_tokens], position of each token [num_tokens], cu_seqlens [num_chunks + 1]
    int32, context_lens [num_chunks] int32)."""
    cu = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    token_chunk = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    positions = starts[token_chunk] + np.arange(cu[-1], dtype=np.int64) - cu[:-1][token_chunk]
    return token_chunk, positions, cu.astype(np.int32), (starts + lengths).astype(np.int32)
