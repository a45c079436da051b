"""Sequence: one request's state inside a worker (tokens, progress, sampling state, finish)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pipeline.protocol import PromptLogprobs, SamplingParams

# The overlap pipeline appends this for a token the model has sampled but the host has not read yet
# (host lengths advance at launch; the value is filled one step late). Never a valid token id: the
# model's input for it is taken from the previous step's sampled tokens on the device.
PLACEHOLDER_TOKEN_ID = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for admission (new or preempted)
    RESERVED = "reserved"  # holds KV blocks, waiting for a prefill worker to fill them (DecodeOnly)
    RUNNING = "running"  # holds KV blocks, scheduled every step
    PAUSED = "paused"  # holds KV blocks, not scheduled: its KV is moving to another worker (live migration)
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + output may not exceed this (max_tokens and max_length folded in)
    sampling_state: Any = None  # pipeline.sampler.SequenceSamplingState, owned here, read by the sampler
    token_ids: list[int] = field(default_factory=list)  # prompt followed by output
    num_computed_tokens: int = 0  # leading tokens whose KV is written in this worker's cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at the last admission
    # speculative decoding: leading tokens whose draft-model KV is written (trails num_computed_tokens
    # by at most two tokens after a verify step), and whether this request speculates at all
    num_draft_computed_tokens: int = 0
    speculates: bool = False
    num_preemptions: int = 0
    is_prefill_only: bool = False  # PrefillOnly role: stop after the first token, keep blocks until shipped
    is_warmup: bool = False  # a prefix warm-up (pipeline/prefix_warmup.py): computed in idle steps, never sampled
    family_id: str = ""  # the request this sequence is a choice of (its own id for choice 0)
    index: int = 0  # which choice (n > 1)
    # service order under scheduling_policy "priority" (pipeline/scheduling_policy.py): lower first, then arrival
    priority: int = 0
    arrival: int = 0  # stamped by the scheduler as the request arrives (a further choice: its parent's)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    # with params.prompt_logprobs: filled as the prompt's chunks run here (pipeline/prompt_logprobs.py),
    # or handed over with the KV by the prefill worker; sent once, with the first token
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False
    text: str = ""

    def __post_init__(self) -> None:
        self.family_id = self.family_id or self.request_id
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = PromptLogprobs()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.sampling_state is not None:
            self.sampling_state.output_token_ids.append(token_id)

    def fill_token(self, position: int, token_id: int) -> None:
        """The overlap pipeline read the token sampled for ``position``: replace its placeholder."""
        self.token_ids[position] = token_id
        if self.sampling_state is not None:
            self.sampling_state.output_token_ids[position - self.num_prompt_tokens] = token_id

    def drop_placeholders(self) -> None:
        """Remove tokens still unread at the end (a finished request's one step too many)."""
        while self.token_ids and self.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
            self.token_ids.pop()
            if self.sampling_state is not None:
                self.sampling_state.output_token_ids.pop()
