"""What the serving benchmark sends and when: seeded arrivals and prompts of exact token lengths.

Conventions follow vLLM's ``bench serve``: inter-arrival gaps drawn from a gamma distribution with
shape ``burstiness`` and mean ``1 / rate`` (burstiness 1 = a Poisson process, < 1 burstier, > 1 more
regular; rate ``inf`` sends everything at once). The gaps are drawn once per seed for a unit rate
and divided by the rate, so every rate of a sweep replays the same pattern, only faster.

Prompts are random text built from the server's own tokenizer so that each one encodes to exactly
the length asked for (after the chat template, for chat endpoints): random token ids are decoded and
re-encoded until the round trip is stable, then trimmed or padded to the length.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import numpy as np

from pipeline.tokenizer import apply_chat_template, encode_prompt

CHAT_ENDPOINT = "/v1/chat/completions"


@dataclass(frozen=True)
class BenchRequest:
    prompt: str  # the completion prompt, or the user message's content on a chat endpoint
    prompt_len: int  # tokens the server sees (chat template included)
    output_len: int  # max_tokens
    group: str  # "random", "short" or "long": metrics are also reported per group
    arrival_s: float  # offset from the start of the run


@dataclass(frozen=True)
class WorkloadSpec:
    dataset: str = "random"  # "random" or "mixed"
    num_prompts: int = 100
    input_len: int = 128  # random: every request
    output_len: int = 128
    long_fraction: float = 0.2  # mixed: this share of requests is long-prompt / short-output
    long_input_len: int = 1536
    long_output_len: int = 8
    short_input_len: int = 64
    short_output_len: int = 128
    seed: int = 0

    def shapes(self) -> list[tuple[str, int, int]]:
        """(group, input_len, output_len) per request, in arrival order."""
        if self.dataset == "random":
            return [("random", self.input_len, self.output_len)] * self.num_prompts
        if self.dataset != "mixed":
            raise ValueError(f"dataset must be 'random' or 'mixed' (got {self.dataset!r})")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long fraction must be in [0, 1] (got {self.long_fraction})")
        num_long = round(self.long_fraction * self.num_prompts)
        groups = ["long"] * num_long + ["short"] * (self.num_prompts - num_long)
        random.Random(self.seed).shuffle(groups)
        return [(g, self.long_input_len, self.long_output_len) if g == "long"
                else (g, self.short_input_len, self.short_output_len) for g in groups]


def unit_rate_gaps(num: int, burstiness: float, seed: int) -> np.ndarray:
    """Inter-arrival gaps for one request per second (the first request arrives at 0)."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0 (got {burstiness})")
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / burstiness, size=num)
    gaps[0] = 0.0
    return gaps


def arrival_offsets(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of ``num`` requests is sent."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0 (got {rate})")
    if math.isinf(rate):
        return [0.0] * num
    return np.cumsum(unit_rate_gaps(num, burstiness, seed) / rate).tolist()


class PromptBuilder:
    """Random prompts of exact token length for one tokenizer (and, for chat, its chat template)."""

    def __init__(self, tokenizer, is_chat: bool) -> None:
        self.tokenizer = tokenizer
        self.is_chat = is_chat
        special = set(tokenizer.all_special_ids)
        # tokens that are text on their own (no partial UTF-8 byte) and encode back to themselves
        self._ordinary_ids = [i for i in range(len(tokenizer)) if i not in special
                              and "\ufffd" not in (piece := tokenizer.decode([i]))
                              and tokenizer.encode(piece, add_special_tokens=False) == [i]]
        self.overhead = self.encoded_len("")  # the chat template's tokens, or the tokenizer's BOS

    def encoded_len(self, text: str) -> int:
        if self.is_chat:
            return len(apply_chat_template(self.tokenizer, [{"role": "user", "content": text}]))
        return len(encode_prompt(self.tokenizer, text))

    def build(self, length: int, rng: random.Random) -> tuple[str, int]:
        """A prompt that encodes to ``length`` tokens (or as close as the tokenizer allows) and its length."""
        target = length - self.overhead
        if target < 1:
            raise ValueError(f"a prompt of {length} tokens cannot hold any text after the chat template or "
                             f"special tokens ({self.overhead} tokens)")
        ids = [rng.choice(self._ordinary_ids) for _ in range(target)]
        text = self.tokenizer.decode(ids)
        for _ in range(64):  # decode/encode is not a bijection: cut or extend by the difference, recheck
            error = self.encoded_len(text) - length
            if error == 0:
                break
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            ids = ids[:len(ids) - error] if error > 0 else ids + [rng.choice(self._ordinary_ids) for _ in range(-error)]
            text = self.tokenizer.decode(ids)
        return text, self.encoded_len(text)


def build_workload(spec: WorkloadSpec, builder: PromptBuilder, salt: int = 0) -> list[BenchRequest]:
    """The requests of ``spec``, all arriving at 0 (``scheduled`` gives a run's own times). Each
    ``salt`` draws other prompts of the same shapes (a sweep's runs must not hit each other's prefix cache)."""
    rng = random.Random(f"{spec.seed}/{salt}")
    requests = []
    for group, input_len, output_len in spec.shapes():
        prompt, prompt_len = builder.build(input_len, rng)
        requests.append(BenchRequest(prompt, prompt_len, output_len, group, 0.0))
    return requests


def scheduled(requests: list[BenchRequest], rate: float, burstiness: float, seed: int) -> list[BenchRequest]:
    """The same requests with the arrival times of one run at ``rate`` requests/s."""
    offsets = arrival_offsets(len(requests), rate, burstiness, seed)
    return [replace(r, arrival_s=t) for r, t in zip(requests, offsets)]
