"""Acceptance counters of speculative decoding (vLLM's spec_decode metric names), per worker since start."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0  # verify steps of one request that had at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted drafts plus the target's own token of each verify
    accepted_per_position: list[int] = field(default_factory=list)  # [K]: drafts accepted at position i

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step of a request (1 = nothing accepted, K + 1 = everything)."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0

    def load_fields(self) -> dict:
        """The counters as ``WorkerLoad`` fields (the router exports them on /metrics)."""
        return dict(spec_num_drafts=self.num_drafts, spec_num_draft_tokens=self.num_draft_tokens,
                    spec_num_accepted_tokens=self.num_accepted_tokens,
                    spec_accepted_per_position=list(self.accepted_per_position))

    def as_dict(self) -> dict:
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "accepted_per_position": list(self.accepted_per_position),
        }
