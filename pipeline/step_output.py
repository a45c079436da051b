"""``StepOutput``: what one request produced in one engine step, and how several tokens join into one."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.protocol import PromptLogprobs


@dataclass
class StepOutput:
    """What one request produced in one step."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_top_logprobs: int = 0  # the request's ``logprobs`` (top-N asked for)
    prompt_logprobs: PromptLogprobs | None = None  # with the first token, when the request asked for them
    index: int = 0  # which choice (n > 1)
    error: str | None = None  # with finish_reason "error": why
    request_finished: bool = False  # this output ended the request's last running choice
    # the last token ended the request as EOS or a stop token id: it is not part of the text
    is_stop_token: bool = False
    num_preemptions: int = 0  # with finish_reason: how often the scheduler preempted it (for its trace)

    def extend(self, later: StepOutput) -> None:
        """Append ``later``, the same request's next token in the same step (speculative decoding): its
        token and logprobs, and its finish state, which is the joined output's now."""
        self.new_token_ids += later.new_token_ids
        if later.new_logprobs is not None:
            self.new_logprobs = (self.new_logprobs or []) + later.new_logprobs
        self.finish_reason, self.stop_reason, self.is_stop_token = (later.finish_reason, later.stop_reason,
                                                                    later.is_stop_token)
        self.request_finished = later.request_finished
