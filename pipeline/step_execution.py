"""``StepExecutor``: runs a scheduled plan through the model runner — at once (plain, or speculative through
``pipeline/speculative``) or launched on the execution stream (overlap) — and hands each request's new
tokens to the engine's emit callbacks; stop checks and request state stay with the engine."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable

import torch

from pipeline.overlap import InFlightStep, needs_host_tokens
from pipeline.sampler import step_seed
from pipeline.sequence import PLACEHOLDER_TOKEN_ID, Sequence
from pipeline.step_output import StepOutput

Emit = Callable[[Sequence, int, "dict[int, float] | None"], StepOutput]
EmitTokens = Callable[[Sequence, "list[int]", "list[dict[int, float]] | None"], StepOutput]


class StepExecutor:
    def __init__(self, scheduler, runner, kv_manager, speculator=None, stream=None) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.kv_manager = kv_manager
        self.speculator = speculator  # pipeline/speculative: the draft proposes, one target forward verifies
        self.stream = stream  # the overlap pipeline's ExecutionStream, or None

    def run_at_once(self, plan, emit: Emit, emit_tokens: EmitTokens) -> list[StepOutput]:
        """Run ``plan`` and wait for it; ``emit`` each sampled token (``emit_tokens``: a speculative
        request's several), in batch order."""
        for generator, seed in plan_seeds(plan):
            generator.manual_seed(seed)
        if self.speculator is not None:
            return self._run_speculative(plan, emit_tokens)
        sampled = self.runner.execute(plan.chunks, self.kv_manager.block_table)
        token_ids = sampled.token_ids if sampled is not None else []
        advanced = self.scheduler.update(plan, token_ids)
        outputs: list[StepOutput] = []
        for i, seq in enumerate(advanced):
            logprobs = sampled.logprobs[i] if sampled.logprobs is not None else None
            outputs.append(emit(seq, token_ids[i], logprobs))
        return outputs

    def _run_speculative(self, plan, emit_tokens: EmitTokens) -> list[StepOutput]:
        """Run ``plan`` through ``pipeline/speculative``: a request may emit several tokens."""
        results = self.speculator.run(plan.chunks, self.kv_manager.block_table)
        for chunk, result in zip(plan.chunks, results):
            chunk.seq.num_computed_tokens = result.num_computed_tokens
            chunk.seq.num_draft_computed_tokens = result.num_draft_computed_tokens
        self._publish_written(plan.chunks)  # before the tokens: a request they end lets go of its blocks
        outputs = [emit_tokens(chunk.seq, result.token_ids, result.logprobs)
                   for chunk, result in zip(plan.chunks, results) if result.token_ids]
        self._publish_written(plan.chunks)  # the accepted tokens' blocks, now that the tokens are known
        self.scheduler.warmups.end_if_complete()
        return outputs

    def _publish_written(self, chunks) -> None:
        """Publish to the prefix cache the blocks whose KV both models have written, of every sequence that still
        holds its blocks (a finished prefill-only request does: they wait for the transfer)."""
        for chunk in chunks:
            seq = chunk.seq
            if self.kv_manager.has_sequence(seq.request_id):
                num_written = min(seq.num_computed_tokens, seq.num_draft_computed_tokens, seq.num_tokens)
                self.kv_manager.register_computed(seq.request_id, seq.token_ids, num_written)

    def launch(self, plan, previous_read: Future) -> InFlightStep:
        """Queue ``plan`` on the execution stream; lengths advance now, token values come when the engine
        reads the step."""
        seeds = plan_seeds(plan)  # is_sampling and output positions are read before the lengths advance
        future = self.runner.launch(plan.chunks, self.kv_manager.block_table, self.stream, seeds,
                                    masks_after=previous_read)
        sampled_chunks = [chunk for chunk in plan.chunks if chunk.is_sampling]
        sampled = self.scheduler.update(plan, [PLACEHOLDER_TOKEN_ID] * len(sampled_chunks), register=False)
        return InFlightStep(plan, future, sampled, [seq.num_tokens - 1 for seq in sampled],
                            needs_host_tokens=any(needs_host_tokens(seq) for seq in sampled))


def plan_seeds(plan) -> list[tuple[torch.Generator, int]]:
    """A seed and the output position fix each draw of a seeded request: the same tokens alone or
    batched, after preemption, with overlap on or off, or when another worker sampled the first token."""
    seeds = []
    for chunk in plan.chunks:
        state = chunk.seq.sampling_state
        if chunk.is_sampling and state.generator is not None:
            seeds.append((state.generator, step_seed(chunk.seq.params.seed, chunk.seq.num_output_tokens)))
    return seeds
