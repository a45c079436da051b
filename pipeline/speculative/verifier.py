"""The target's side of a speculative step: from the logits of each speculating request's k + 1 verify
rows to the tokens it emits, with every logits processor applied exactly as without speculation.

Row j of a request is processed as the request would be after its first j drafts were accepted:
penalties count them, bad words and min_tokens see them (each row gets the state it would have had).
A grammar-constrained request's row j is masked by what its grammar allows after those drafts. The
draft's distribution q only shapes what is proposed, never what is emitted (rejection sampling; for a seeded
request the coupled path, which emits the plain sampler's tokens), so it carries temperature / top-k / top-p /
min-p and the grammar's mask but no other processor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pipeline.sampler import apply_bitmask, apply_logits_processing, gather_logprobs, sampling_probs
from pipeline.sampling_metadata import SequenceSamplingState, build_sampling_metadata
from pipeline.scheduler import ScheduledChunk
from pipeline.speculative.grammar import masks_along
from pipeline.speculative.proposer import DraftProposal
from pipeline.speculative.rejection_sampler import rejection_sample
from pipeline.speculative.seeds import position_generator


@dataclass
class VerifiedTokens:
    token_ids: list[int]  # accepted drafts, then one target token
    logprobs: list[dict[int, float]] | None  # one entry per token (raw target logits), or None when not asked


def verify(logits: torch.Tensor, chunks: list[ScheduledChunk], proposal: DraftProposal, vocab_size: int,
           global_generator: torch.Generator) -> list[VerifiedTokens]:
    """``logits``: [sum(k_i + 1), vocab] raw target logits of the speculating ``chunks``' verify rows."""
    device = logits.device
    states = [_state_after(chunk.seq.sampling_state, drafts[:j])
              for chunk, drafts in zip(chunks, proposal.token_ids) for j in range(len(drafts) + 1)]
    metadata = None
    processed = logits
    if not all(s.is_plain_greedy for s in states):
        metadata = build_sampling_metadata(states, vocab_size, device)
        if metadata.needs_processing:
            processed = apply_logits_processing(logits, metadata)  # [rows, vocab]
    processed = _apply_grammars(processed, logits, chunks, proposal, vocab_size)
    num_drafts = [len(drafts) for drafts in proposal.token_ids]
    is_coupled = [chunk.seq.params.seed is not None and not chunk.seq.sampling_state.is_greedy for chunk in chunks]
    target_probs = torch.zeros(1, vocab_size, device=device).expand(len(states), vocab_size)
    if metadata is not None and not metadata.is_all_greedy:
        probs = sampling_probs(processed, metadata)  # [num_random, vocab]: what the plain sampler races on
        target_probs = torch.zeros(len(states), vocab_size, device=device)
        # rejection sampling compares p with q (normalized); the coupled path races on the plain sampler's weights
        coupled_rows = torch.tensor([c for c, k in zip(is_coupled, num_drafts) for _ in range(k + 1)],
                                    device=device)[metadata.random_rows]
        target_probs[metadata.random_rows] = torch.where(coupled_rows[:, None], probs,
                                                         probs / probs.sum(dim=-1, keepdim=True))
    draft_probs = proposal.probs
    if draft_probs is None:
        draft_probs = torch.zeros(1, vocab_size, device=device).expand(sum(num_drafts), vocab_size)
    emitted = rejection_sample(
        target_probs, processed.argmax(dim=-1), draft_probs,
        torch.tensor([t for drafts in proposal.token_ids for t in drafts], dtype=torch.int64, device=device),
        num_drafts, [chunk.seq.sampling_state.is_greedy for chunk in chunks],
        _generators(chunks, num_drafts, device), global_generator, is_coupled,
    )
    return _with_logprobs(logits, chunks, num_drafts, emitted)


def _apply_grammars(processed: torch.Tensor, logits: torch.Tensor, chunks: list[ScheduledChunk],
                    proposal: DraftProposal, vocab_size: int) -> torch.Tensor:
    """Grammar masks last, as the sampler applies them: row j of a constrained request allows what its
    grammar allows after its first j drafts."""
    first_row = 0
    for chunk, drafts in zip(chunks, proposal.token_ids):
        matcher = chunk.seq.sampling_state.grammar
        if matcher is not None:
            if processed is logits:
                processed = logits.clone()  # the raw logits still give the logprobs
            rows = slice(first_row, first_row + len(drafts) + 1)
            processed[rows] = apply_bitmask(processed[rows], masks_along(matcher, drafts, vocab_size).to(logits.device))
        first_row += len(drafts) + 1
    return processed


def _state_after(state: SequenceSamplingState, drafts: list[int]) -> SequenceSamplingState:
    """``state`` as it would be once ``drafts`` were emitted (no generator: the draws come from
    per-position generators; no grammar: its masks are applied by ``_apply_grammars``)."""
    return dataclasses.replace(state, output_token_ids=state.output_token_ids + drafts, generator=None, grammar=None)


def _generators(chunks: list[ScheduledChunk], num_drafts: list[int],
                device: torch.device) -> list[torch.Generator | None]:
    """One per verify row: seeded requests draw by output position (the plain sampler's draw there), the others
    from the global generator."""
    generators: list[torch.Generator | None] = []
    for chunk, k in zip(chunks, num_drafts):
        seq = chunk.seq
        seed = seq.params.seed
        for j in range(k + 1):
            is_seeded = seed is not None and not seq.sampling_state.is_greedy
            generators.append(position_generator(seed, seq.num_output_tokens + j, device) if is_seeded else None)
    return generators


def _with_logprobs(logits: torch.Tensor, chunks: list[ScheduledChunk], num_drafts: list[int],
                   emitted: list[list[int]]) -> list[VerifiedTokens]:
    """Each emitted token's logprobs from the raw logits of the row that decided it."""
    rows, tokens, nums = [], [], []
    first_row = 0
    for chunk, k, token_ids in zip(chunks, num_drafts, emitted):
        num = chunk.seq.params.logprobs
        if num is not None:
            rows += range(first_row, first_row + len(token_ids))
            tokens += token_ids
            nums += [num] * len(token_ids)
        first_row += k + 1
    entries = iter(gather_logprobs(logits[rows], torch.tensor(tokens, dtype=torch.int64, device=logits.device),
                                   nums) or ()) if rows else iter(())
    return [VerifiedTokens(token_ids, [next(entries) for _ in token_ids] if chunk.seq.params.logprobs is not None
                           else None)
            for chunk, token_ids in zip(chunks, emitted)]
