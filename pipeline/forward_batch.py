"""ForwardBatch: the flat, unpadded batch a model runs in one step.

Tokens of all scheduled sequences are concatenated (prefill chunks and decode tokens alike);
``cu_seqlens_q`` marks where each sequence's tokens start. The model runner builds it from the
scheduler's plan; models and kernels only read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, absolute position of each token in its sequence
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32, offsets of each sequence's tokens
    context_lens: torch.Tensor  # [num_seqs] int32, K/V length of each sequence after this step
    slot_mapping: torch.Tensor  # [num_tokens] int64, KV slot (block_id * page_size + offset) per token
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    logits_indices: torch.Tensor  # [num_sampled] int64, rows of the flat batch whose logits are needed

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_seqs(self) -> int:
        return self.context_lens.numel()


def flat_token_layout(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, ...]:
    """Chunks of ``lengths[i]`` tokens starting at position ``starts[i]`` (int64 arrays), laid out flat:
    (chunk of each token [num_tokens], position of each token [num_tokens], cu_seqlens [num_chunks + 1]
    int32, context_lens [num_chunks] int32)."""
    cu = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    token_chunk = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    positions = starts[token_chunk] + np.arange(cu[-1], dtype=np.int64) - cu[:-1][token_chunk]
    return token_chunk, positions, cu.astype(np.int32), (starts + lengths).astype(np.int32)
