"""A ``ForwardBatch`` from explicit token runs: the speculative step's forwards run tokens the
sequences do not hold yet (drafts), so they are built here rather than from the persistent batch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.forward_batch import ForwardBatch, flat_token_layout, with_final_layer_rows


@dataclass
class TokenRun:
    """Tokens at positions ``[start, start + len(token_ids))`` of one sequence, whose KV lands in its blocks."""

    token_ids: list[int]
    start: int
    block_table: list[int]


def build_forward_batch(runs: list[TokenRun], logits_rows: list[int], page_size: int, device: torch.device,
                        sampled_rows_only: bool = True) -> ForwardBatch:
    """One flat batch over ``runs`` (each non-empty); ``logits_rows``: flat token indices whose logits are needed,
    the only rows that leave the last layer unless ``sampled_rows_only`` is False (``ForwardBatch.final_layer``)."""
    lengths = np.array([len(run.token_ids) for run in runs], dtype=np.int64)  # [num_runs]
    starts = np.array([run.start for run in runs], dtype=np.int64)  # [num_runs]
    run_of_token, positions, cu_seqlens, context_lens = flat_token_layout(starts, lengths)
    width = max(len(run.block_table) for run in runs)
    block_tables = np.zeros((len(runs), width), dtype=np.int32)  # [num_runs, width], padded with 0
    for i, run in enumerate(runs):
        block_tables[i, :len(run.block_table)] = run.block_table
    block_of_token = block_tables[run_of_token, positions // page_size].astype(np.int64)
    input_ids = np.fromiter((t for run in runs for t in run.token_ids), dtype=np.int64, count=len(positions))

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)

    rows = np.asarray(logits_rows, dtype=np.int64)
    batch = ForwardBatch(
        input_ids=tensor(input_ids),
        positions=tensor(positions),
        cu_seqlens_q=tensor(cu_seqlens),
        context_lens=tensor(context_lens),
        slot_mapping=tensor(block_of_token * page_size + positions % page_size),
        block_tables=tensor(block_tables),
        logits_indices=tensor(rows),
    )
    if not sampled_rows_only:
        return batch
    return with_final_layer_rows(batch, cu_seqlens, context_lens, block_tables, rows, tensor)
