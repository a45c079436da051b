"""``SequenceBuilder``: a request's ``Sequence`` as an engine runs it (token limits, sampling state,
speculation) and the output tokens a migrated request resumes with, checked before anything runs."""

from __future__ import annotations

import torch

from pipeline.protocol import SamplingParams
from pipeline.request_validation import RequestError, resolve_bad_words
from pipeline.sampler import SequenceSamplingState
from pipeline.sequence import Sequence


class SequenceBuilder:
    def __init__(self, tokenizer, vocab_size: int, max_length: int, eos_token_ids: set[int], device,
                 is_speculative: bool) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.is_speculative = is_speculative

    def build(self, seq_id: str, prompt_token_ids: list[int], params: SamplingParams, prefill_only: bool,
              grammar=None, family_id: str | None = None, index: int = 0) -> Sequence:
        """One choice of a request (``family_id``: the request's id, ``index``: which choice); ``grammar``:
        the matcher of its structured-output constraint, if any."""
        max_total = self.max_length
        if params.max_tokens is not None:
            max_total = min(max_total, len(prompt_token_ids) + params.max_tokens)
        if prefill_only:
            max_total = len(prompt_token_ids) + 1
        seq = Sequence(seq_id, list(prompt_token_ids), params, max_total_tokens=max_total,
                       is_prefill_only=prefill_only, family_id=family_id or seq_id, index=index)
        seq.speculates = self.is_speculative and not prefill_only
        generator = torch.Generator(device=self.device) if params.seed is not None else None
        seq.sampling_state = SequenceSamplingState(
            params=params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=[],
            eos_token_ids=self.eos_token_ids,
            bad_words_token_ids=resolve_bad_words(self.tokenizer, params.bad_words),
            generator=generator,
            grammar=grammar,
        )
        return seq

    def resume(self, seq: Sequence, token_ids: list[int], prefill_only: bool) -> None:
        """Append the output tokens another worker already produced (a migrated request) to ``seq``; a
        RequestError if they cannot be its outputs."""
        if prefill_only or seq.params.num_sequences > 1:
            raise RequestError("resume_token_ids: only a single-choice request decoded here can resume")
        if len(seq.prompt_token_ids) + len(token_ids) >= seq.max_total_tokens:
            raise RequestError("resume_token_ids: nothing is left to generate")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"resume_token_ids: token id {bad} is outside the vocabulary")
        grammar = seq.sampling_state.grammar
        for token_id in token_ids:
            if grammar is not None and not grammar.accept(token_id):
                raise RequestError("resume_token_ids: the tokens do not follow the request's constraint")
            seq.append_token(token_id)
