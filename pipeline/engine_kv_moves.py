"""The engine's entry points for KV that crosses workers: a part of ``pipeline.engine.LLMEngine``.

``KVMoves`` is a mixin (it uses the engine's sequences, scheduler, runner and step in flight), kept apart
because it is one concern: a prefill-only request's blocks held until shipped, a decode worker's
reservation for a remote prefill and the first token that comes with the KV, a live-migrated stream whose
KV arrived, and a draining worker pausing its streams for the handoff.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Container

from pipeline.protocol import PromptLogprobs
from pipeline.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from pipeline.engine import StepOutput


class KVMoves:
    """P/D and live-migration hooks of ``LLMEngine`` (see the module docstring)."""

    def release_blocks(self, request_id: str) -> None:
        """Free the blocks a finished prefill-only request kept for shipping."""
        if self._held.pop(request_id, None) is not None:
            self.kv_manager.free(request_id)

    def reserve_remote(self) -> list[Sequence]:
        return self.scheduler.reserve_remote()

    def activate_remote(self, request_id: str, first_token_id: int, first_logprobs: dict[int, float] | None,
                        prompt_logprobs: PromptLogprobs | None = None) -> StepOutput:
        """The prompt's KV arrived: record the first token (sampled by the prefill worker, with the
        prompt's logprobs when asked for), run stop checks on it, and let the sequence decode from the next step."""
        seq = self._sequences[request_id]
        if seq.prompt_logprobs is not None:
            seq.prompt_logprobs = prompt_logprobs or PromptLogprobs()
        self.scheduler.activate_remote(seq, first_token_id)
        return self._emit(seq, first_token_id, first_logprobs)

    def activate_migrated(self, request_id: str, num_draft_computed_tokens: int | None = None) -> None:
        """A migrated stream's KV arrived from the worker that decoded it so far (every token but the last,
        which the client has already): decode on from the next step, emitting nothing now."""
        seq = self._sequences[request_id]
        seq.prompt_logprobs_sent = True  # sent with the first token, before the move
        self.scheduler.activate_migrated(seq, num_draft_computed_tokens)

    def pause_decoding(self, skip: Container[str] = ()) -> tuple[list[StepOutput], list[Sequence]]:
        """Live migration on drain: stop decoding every single-choice request that is decoding (its KV
        then covers every token but the last, which it emitted), keeping its blocks for the handoff;
        requests in ``skip`` go on. Returns the outputs of a step still in flight (read first, so nothing
        is computed past them) and the requests paused now; ``resume_paused`` or ``abort_request`` ends a
        pause."""
        def pausable() -> list[Sequence]:
            return [seq for seq in self.scheduler.running
                    if seq.params.num_sequences == 1 and not seq.is_prefill_only and seq.request_id not in skip
                    and seq.num_output_tokens > 0]
        if not pausable():
            return [], []
        outputs = self._read(self._take_in_flight()) if self._in_flight is not None else []
        paused = [seq for seq in pausable() if seq.num_computed_tokens == seq.num_tokens - 1]
        for seq in paused:
            self.scheduler.pause(seq)
            self.runner.forget(seq.request_id)  # back as a new row of the persistent batch, if resumed
        return outputs, paused

    def resume_paused(self, request_id: str) -> None:
        seq = self._sequences.get(request_id)
        if seq is not None and seq.status is SequenceStatus.PAUSED:
            self.scheduler.unpause(seq)
