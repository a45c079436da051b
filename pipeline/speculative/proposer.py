"""DraftProposer: the draft model's side of a speculative step.

Pass 1 catches the draft's KV up with every scheduled chunk (prompt chunks, and the one or two tokens a
decoding request gained in its last step) and drafts the first token of each speculating request; passes
2..K feed each draft back in, one token per request, so request ``i`` ends with ``k_i`` drafted tokens and
the distribution ``q`` each was drawn from. The draft's KV lands in its own cache through the target's
block tables (the scheduler reserved room for every drafted position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels import Kernels
from pipeline.sampler import Sampler, apply_bitmask, distribution
from pipeline.sampling_metadata import SamplingArrays
from pipeline.scheduler import ScheduledChunk
from pipeline.speculative.draft import DraftModel
from pipeline.speculative.flat_batch import TokenRun, build_forward_batch
from pipeline.speculative.grammar import DraftWalk
from pipeline.speculative.seeds import position_generator


@dataclass
class DraftProposal:
    token_ids: list[list[int]]  # per speculating chunk, in chunk order: its k_i drafted tokens
    # [sum k_i, vocab]: the distribution each draft was drawn from, in the same order (rows of greedy
    # requests are zero); None when every speculating request is greedy
    probs: torch.Tensor | None


class _SpeculatingRows:
    """The dense sampling parameters of the speculating requests, as tensors (read once per step)."""

    def __init__(self, chunks: list[ScheduledChunk], vocab_size: int, device: torch.device) -> None:
        arrays = SamplingArrays.from_states([c.seq.sampling_state for c in chunks], vocab_size)
        self.is_greedy = arrays.is_greedy.tolist()
        self.vocab_size = vocab_size
        self.temperature = torch.from_numpy(arrays.temperature).to(device)
        self.top_k = torch.from_numpy(arrays.top_k).to(device) if (arrays.top_k < vocab_size).any() else None
        self.top_p = torch.from_numpy(arrays.top_p).to(device) if (arrays.top_p < 1.0).any() else None
        self.min_p = torch.from_numpy(arrays.min_p).to(device) if (arrays.min_p > 0.0).any() else None
        self.top_k_values = arrays.top_k

    def probs(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """[len(rows), vocab] normalized draft distributions of ``rows`` (indices into the speculating requests)."""
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        pick = (lambda t: None if t is None else t[index])
        probs = distribution(logits, self.temperature[index], pick(self.top_k), pick(self.top_p), pick(self.min_p),
                             int(self.top_k_values[rows].max()))
        return probs / probs.sum(dim=-1, keepdim=True)


class DraftProposer:
    def __init__(self, draft: DraftModel, kv_cache: torch.Tensor, kernels: Kernels, sampler: Sampler,
                 device: torch.device) -> None:
        self.draft = draft
        self.kv_cache = kv_cache  # [draft_layers, 2, num_blocks, page_size, kv_heads, head_dim]
        self.kernels = kernels
        self.sampler = sampler  # its vocabulary (the target's) and its global generator
        self.device = device
        self.page_size = kv_cache.shape[3]

    @torch.inference_mode()
    def propose(self, chunks: list[ScheduledChunk], block_table: Callable[[str], list[int]]) -> DraftProposal:
        speculating = [c for c in chunks if c.num_lookahead > 0]
        rows = _SpeculatingRows(speculating, self.sampler.vocab_size, self.device) if speculating else None
        drafts: list[list[int]] = [[] for _ in speculating]
        prob_rows: list[list[torch.Tensor | None]] = [[] for _ in speculating]
        logits = self._catch_up(chunks, block_table)  # [len(speculating), vocab]
        active = list(range(len(speculating)))
        # structured output: drafts follow the grammar (its matchers walk along and are rolled back)
        walk = DraftWalk([c.seq.sampling_state.grammar for c in speculating], self.sampler.vocab_size)
        try:
            for j in range(max((c.num_lookahead for c in speculating), default=0)):
                if j > 0:
                    active = [i for i in active if speculating[i].num_lookahead > j]
                    logits = self._feed_back(speculating, active, drafts, block_table)
                masks = walk.mask(active)
                if masks is not None:
                    live, bitmask = masks
                    logits[live] = apply_bitmask(logits[live], bitmask.to(logits.device))
                tokens, probs = self._draw(logits, speculating, active, rows, position=j)
                for local, i in enumerate(active):
                    drafts[i].append(tokens[local])
                    prob_rows[i].append(None if probs is None else probs[local])
                    walk.advance(i, tokens[local])
        finally:
            walk.rollback()
        probs = None
        if rows is not None and not all(rows.is_greedy):
            zeros = torch.zeros(self.sampler.vocab_size, device=self.device)
            probs = torch.stack([p if p is not None else zeros for per_request in prob_rows for p in per_request])
        return DraftProposal(drafts, probs)

    def _catch_up(self, chunks: list[ScheduledChunk], block_table) -> torch.Tensor | None:
        """Run every token the draft has not seen up to each chunk's end; logits of the speculating ones."""
        runs: list[TokenRun] = []
        logits_rows: list[int] = []
        num_tokens = 0
        for chunk in chunks:
            seq = chunk.seq
            start, end = seq.num_draft_computed_tokens, chunk.start + chunk.num_tokens
            if start >= end:
                if chunk.num_lookahead:
                    raise RuntimeError(f"{seq.request_id}: the draft is ahead of a decoding request")
                continue
            runs.append(TokenRun(seq.token_ids[start:end], start, block_table(seq.request_id)))
            num_tokens += end - start
            if chunk.num_lookahead:
                logits_rows.append(num_tokens - 1)
        if not runs:
            return None
        return self._forward(runs, logits_rows)

    def _feed_back(self, speculating: list[ScheduledChunk], active: list[int], drafts: list[list[int]],
                   block_table) -> torch.Tensor:
        """One more draft position for each ``active`` request: its last draft goes in, the next comes out."""
        runs = []
        for i in active:
            seq = speculating[i].seq
            position = seq.num_tokens - 1 + len(drafts[i])  # where the last draft sits
            runs.append(TokenRun([drafts[i][-1]], position, block_table(seq.request_id)))
        return self._forward(runs, list(range(len(runs))))

    def _forward(self, runs: list[TokenRun], logits_rows: list[int]) -> torch.Tensor:
        batch = build_forward_batch(runs, logits_rows, self.page_size, self.device)
        # the target may emit ids past a smaller draft vocabulary (its padded tail): the draft reads id 0
        # there (only its guesses suffer: the target checks every draft)
        batch.input_ids.masked_fill_(batch.input_ids >= self.draft.vocab_size, 0)
        hidden = self.draft.model(batch, self.kv_cache, self.kernels)  # [rows, hidden]: only they leave the last layer
        logits = self.draft.model.compute_logits(batch.sampled_rows(hidden)).float()  # [rows, draft vocab]
        return _to_vocab(logits, self.sampler.vocab_size)

    def _draw(self, logits: torch.Tensor, speculating: list[ScheduledChunk], active: list[int],
              rows: _SpeculatingRows, position: int) -> tuple[list[int], torch.Tensor | None]:
        """Draft position ``position`` (0-based within the step) of each active request: greedy rows take
        the argmax; the others draw from their distribution q with their own per-position noise."""
        tokens = logits.argmax(dim=-1)  # [len(active)]
        random = [local for local, i in enumerate(active) if not rows.is_greedy[i]]
        if not random:
            return tokens.tolist(), None
        q = torch.zeros_like(logits)  # [len(active), vocab], zero rows for greedy requests
        q[random] = rows.probs(logits[random], [active[local] for local in random])
        for local in random:
            seq = speculating[active[local]].seq
            noise = self._noise(seq, seq.num_output_tokens + position, logits.shape[-1])
            tokens[local] = (q[local] / noise).argmax()  # exponential race: token t with probability q[t]
        return tokens.tolist(), q

    def _noise(self, seq, output_position: int, vocab_size: int) -> torch.Tensor:
        seed = seq.params.seed
        # a seeded request proposes from the noise its target token at that position is drawn with: the draft is
        # accepted exactly when it is the token the target samples there (rejection_sampler, the coupled path)
        generator = (position_generator(seed, output_position, self.device) if seed is not None
                     else self.sampler.global_generator(self.device))
        noise = torch.empty(vocab_size, device=generator.device).exponential_(generator=generator)
        return noise.to(self.device).clamp_min_(torch.finfo(noise.dtype).tiny)


def _to_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits on the target's vocabulary: ids past the draft's are never proposed, ids past the target's dropped."""
    width = logits.shape[-1]
    if width == vocab_size:
        return logits
    if width > vocab_size:
        return logits[:, :vocab_size]
    pad = torch.full((logits.shape[0], vocab_size - width), float("-inf"), device=logits.device)
    return torch.cat([logits, pad], dim=-1)
