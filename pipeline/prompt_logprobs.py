"""Prompt logprobs: the logprob of each prompt token given the tokens before it, computed where the
prompt is prefilled, chunk by chunk, from the hidden states the forward already made.

The hidden state of position p predicts token p + 1, so a chunk covering positions [start, end) of a
P-token prompt scores prompt tokens start + 1 .. min(end, P - 1). Each request's results land in its
``Sequence.prompt_logprobs`` at their positions (a chunk recomputed after preemption overwrites, never
appends twice), and the engine sends the whole list with the first token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.protocol import PromptLogprobs, TokenLogprob

ROWS_PER_SLICE = 256  # logits of at most this many rows at once: [rows, vocab] fp32 each


@dataclass
class _Span:
    seq: object  # pipeline.sequence.Sequence
    first_row: int  # row of the flat batch holding position ``start``
    start: int  # first position of the chunk
    num_rows: int  # positions start .. start + num_rows - 1 score prompt tokens start + 1 .. start + num_rows


def asked(chunks) -> bool:
    """Whether some chunk's request asks for prompt logprobs (one pass over the step's chunks)."""
    return any(chunk.seq.prompt_logprobs is not None for chunk in chunks)


def spans(chunks, chunk_offsets) -> list[_Span]:
    """Which rows of a step's flat batch score prompt tokens: one span per chunk that asks for them.
    ``chunk_offsets[i]``: the flat row of chunk i's first token (a list, an array or cu_seqlens), read
    only when some chunk asks: a step without prompt logprobs costs one pass over its chunks."""
    if not asked(chunks):
        return []
    out = []
    for chunk, offset in zip(chunks, chunk_offsets):
        seq = chunk.seq
        if seq.prompt_logprobs is None:
            continue
        end = min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens - 1)
        if end > chunk.start:
            out.append(_Span(seq, int(offset), chunk.start, end - chunk.start))
    return out


def score(model, hidden: torch.Tensor, step_spans: list[_Span]) -> None:
    """Compute every span's prompt logprobs from ``hidden`` [num_tokens, hidden] and store them on its
    sequence. Runs where the forward ran (the execution stream under overlap)."""
    for span in step_spans:
        seq = span.seq
        num_top = seq.params.prompt_logprobs or 0
        targets = torch.tensor(seq.prompt_token_ids[span.start + 1:span.start + 1 + span.num_rows],
                               dtype=torch.long, device=hidden.device)
        result = PromptLogprobs()
        for lo in range(0, span.num_rows, ROWS_PER_SLICE):
            hi = min(lo + ROWS_PER_SLICE, span.num_rows)
            logits = model.compute_logits(hidden[span.first_row + lo:span.first_row + hi]).float()
            result.extend(_from_logits(logits, targets[lo:hi], num_top))
        seq.prompt_logprobs.truncate(span.start)  # a recomputed chunk replaces what it scored before
        seq.prompt_logprobs.extend(result)


def _from_logits(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> PromptLogprobs:
    logprobs = torch.log_softmax(logits, dim=-1)  # [rows, vocab]
    chosen = logprobs.gather(1, targets[:, None])  # [rows, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top: list[list[TokenLogprob]] = [[] for _ in range(len(targets))]
    if num_top:
        values, ids = logprobs.topk(num_top, dim=-1)
        top = [[TokenLogprob(t, lp) for t, lp in zip(row_ids, row_values)]
               for row_ids, row_values in zip(ids.tolist(), values.tolist())]
    return PromptLogprobs(chosen[:, 0].tolist(), ranks.tolist(), top)


def as_dicts(prompt_logprobs: PromptLogprobs, prompt_token_ids: list[int]) -> list[dict[int, float] | None]:
    """vLLM's offline shape: None for the first position, then prompt token id -> logprob plus the top N."""
    out: list[dict[int, float] | None] = [None]
    for i, logprob in enumerate(prompt_logprobs.logprobs):
        entry = {prompt_token_ids[i + 1]: logprob}
        for lp in prompt_logprobs.top[i]:
            entry.setdefault(lp.token_id, lp.logprob)
        out.append(entry)
    return out
