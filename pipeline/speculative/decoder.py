"""SpeculativeDecoder: one speculative engine step.

1. The draft catches up with every scheduled chunk and drafts ``k_i`` tokens for each decoding request
   the scheduler gave a lookahead (``DraftProposer``).
2. One target forward runs every chunk: prompt chunks as usual, each speculating request's last token
   followed by its drafts (k_i + 1 rows of logits).
3. Rows of ordinary chunks are sampled by the regular sampler; speculating requests are verified
   (``verify``): the accepted drafts plus one target token.

It decides nothing about scheduling and changes no sequence: the engine applies the ``ChunkResult``s.
Rejected positions need no undo: their KV sits past each request's computed length, in blocks it owns,
and is overwritten before anything reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pipeline import prompt_logprobs
from pipeline.model_runner import ModelRunner
from pipeline.scheduler import ScheduledChunk
from pipeline.speculative.draft import DraftModel
from pipeline.speculative.flat_batch import TokenRun, build_forward_batch
from pipeline.speculative.metrics import SpecDecodeStats
from pipeline.speculative.proposer import DraftProposal, DraftProposer
from pipeline.speculative.verifier import verify


@dataclass
class ChunkResult:
    token_ids: list[int]  # emitted tokens (none for a prompt chunk that does not end its prompt)
    logprobs: list[dict[int, float]] | None
    num_computed_tokens: int  # the request's tokens with target KV after this step
    num_draft_computed_tokens: int  # ... with draft KV


class SpeculativeDecoder:
    def __init__(self, runner: ModelRunner, draft: DraftModel, draft_kv_cache: torch.Tensor,
                 num_speculative_tokens: int) -> None:
        self.runner = runner  # the target: model, KV cache, kernels, sampler
        self.proposer = DraftProposer(draft, draft_kv_cache, runner.kernels, runner.sampler, runner.device)
        self.stats = SpecDecodeStats(num_speculative_tokens)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], block_table: Callable[[str], list[int]]) -> list[ChunkResult]:
        """One step over ``chunks``; a result per chunk, in order."""
        proposal = self.proposer.propose(chunks, block_table)
        logits, plain_rows, verify_rows = self._verify_forward(chunks, proposal, block_table)
        plain = [c for c in chunks if c.is_sampling and not c.num_lookahead]
        speculating = [c for c in chunks if c.num_lookahead]
        sampled = iter(())
        if plain:
            runner = self.runner
            plan = runner.sampler.plan([c.seq.sampling_state for c in plain], runner.device)
            out = runner.sampler.sample(logits[plain_rows], plan)
            logprobs = out.logprobs or [None] * len(plain)
            sampled = iter(zip(out.token_ids, logprobs))
        verified = iter(())
        if speculating:
            verified = iter(verify(logits[verify_rows], speculating, proposal, self.runner.sampler.vocab_size,
                                   self.runner.sampler.global_generator(self.runner.device)))
        drafts = iter(proposal.token_ids)
        results = []
        for chunk in chunks:
            end = chunk.start + chunk.num_tokens
            if chunk.num_lookahead:
                k, tokens = len(next(drafts)), next(verified)
                num_accepted = len(tokens.token_ids) - 1
                self.stats.record(k, num_accepted)
                results.append(ChunkResult(tokens.token_ids, tokens.logprobs, end + num_accepted,
                                           min(end + k - 1, end + num_accepted)))
            elif chunk.is_sampling:
                token_id, logprobs = next(sampled)
                results.append(ChunkResult([token_id], None if logprobs is None else [logprobs], end, end))
            else:
                results.append(ChunkResult([], None, end, end))
        return results

    def _verify_forward(self, chunks: list[ScheduledChunk], proposal: DraftProposal,
                        block_table) -> tuple[torch.Tensor, list[int], list[int]]:
        """The target forward: [rows, vocab] logits, and which rows are ordinary samples / verify rows."""
        runs: list[TokenRun] = []
        logits_rows: list[int] = []
        plain_rows: list[int] = []
        verify_rows: list[int] = []
        drafts = iter(proposal.token_ids)
        num_tokens = 0
        offsets: list[int] = []  # flat row of each chunk's first token
        for chunk in chunks:
            offsets.append(num_tokens)
            seq = chunk.seq
            tokens = seq.token_ids[chunk.start:chunk.start + chunk.num_tokens]
            if chunk.num_lookahead:
                tokens = tokens + next(drafts)
                verify_rows += range(len(logits_rows), len(logits_rows) + len(tokens))
                logits_rows += range(num_tokens, num_tokens + len(tokens))
            elif chunk.is_sampling:
                plain_rows.append(len(logits_rows))
                logits_rows.append(num_tokens + len(tokens) - 1)
            runs.append(TokenRun(tokens, chunk.start, block_table(seq.request_id)))
            num_tokens += len(tokens)
        runner = self.runner
        batch = build_forward_batch(runs, logits_rows, runner.page_size, runner.device,
                                    sampled_rows_only=not prompt_logprobs.asked(chunks))
        hidden = runner.model(batch, runner.kv_cache, runner.kernels)  # [num_tokens (or rows: final_layer), hidden]
        prompt_logprobs.score(runner.model, hidden, prompt_logprobs.spans(chunks, offsets))
        logits = runner.model.compute_logits(batch.sampled_rows(hidden)).float()  # [rows, vocab]
        return logits, plain_rows, verify_rows
