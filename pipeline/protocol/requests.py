"""Request-level messages shared by every Tandem process: sampling parameters and outputs."""
from __future__ import annotations

import enum
import math

import msgspec


# struct options of the messages on the per-token path: a msgpack array, the tag first; trailing defaults not sent;
# never tracked by the garbage collector (docs in pipeline/protocol/cluster.py)
HOT_PATH_STRUCT = dict(array_like=True, omit_defaults=True, gc=False, kw_only=True)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_length reached
    ABORT = "abort"  # cancelled by the client or the system
    ERROR = "error"  # the request failed (worker died, transfer failed, ...)


class StructuredOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A constraint on the output's text (OpenAI ``response_format`` and vLLM's extension fields).

    ``kind``: "json" (``value`` is a JSON schema, as JSON text), "json_object" (any JSON object),
    "regex", "choice" (``choices``: the output is exactly one of them) or "grammar" (Lark; llguidance
    also takes its GBNF dialect). ``backend``: "llguidance" (default) or "xgrammar"."""

    kind: str
    value: str = ""
    choices: list[str] = msgspec.field(default_factory=list)
    backend: str | None = None

    def __post_init__(self) -> None:
        kinds = ("json", "json_object", "regex", "choice", "grammar")
        _check(self.kind in kinds, "structured_output.kind", f"must be one of {', '.join(kinds)}", self.kind)
        _check(self.kind != "choice" or bool(self.choices), "choice", "must be a non-empty list of strings", self.choices)
        _check(self.kind not in ("json", "regex", "grammar") or bool(self.value), self.kind, "must not be empty",
               self.value)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-request sampling parameters, named as in vLLM / the OpenAI API.

    Validated on construction and on decode: a bad value raises ``ValueError`` naming the field.
    ``top_k`` of 0 or -1 and ``top_p`` of 1 disable those filters; ``temperature`` 0 is greedy.
    """

    max_tokens: int | None = 16
    # n choices decoded side by side from one prefill (best_of: that many candidates, of which the caller
    # keeps the n most likely); choice i > 0 of a seeded request draws with choice_seed(seed, i)
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    # vLLM's name: the logprob of every prompt token after the first, with the top N alternatives per
    # position (0: the prompt's own tokens only); requests asking for it skip the prefix cache
    prompt_logprobs: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = msgspec.field(default_factory=list)
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1", self.max_tokens)
        _check(1 <= self.n <= MAX_CHOICES, "n", f"must be in [1, {MAX_CHOICES}]", self.n)
        _check(self.best_of is None or self.n <= self.best_of <= MAX_CHOICES, "best_of",
               f"must be in [n, {MAX_CHOICES}] (n is {self.n})", self.best_of)
        _check(_finite(self.temperature) and 0 <= self.temperature <= _FLOAT32_MAX, "temperature",
               "must be >= 0 and a float32 (<= 3.4e38: the sampler divides by it in float32)", self.temperature)
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k >= -1, "top_k", "must be -1 (disabled), 0 (disabled) or >= 1", self.top_k)
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0", self.min_tokens)
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be <= max_tokens ({self.max_tokens})",
            self.min_tokens,
        )
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]", self.logprobs)
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
               "must be in [0, 20]", self.prompt_logprobs)
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2 <= value <= 2, name, "must be in [-2, 2]", value)
        _check(
            _finite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "must be > 0",
            self.repetition_penalty,
        )
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0", self.stop_token_ids)
        _check(all(s for s in self.stop), "stop", "must not contain empty strings", self.stop)
        _check(
            all(_finite(b) and -100 <= b <= 100 for b in self.logit_bias.values()),
            "logit_bias",
            "values must be in [-100, 100]",
            self.logit_bias,
        )
        _check(
            self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
            "allowed_token_ids",
            "must not be empty",
            self.allowed_token_ids,
        )

    @property
    def num_sequences(self) -> int:
        """Sequences a worker decodes for this request: best_of candidates, else n choices."""
        return self.best_of or self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


MAX_CHOICES = 64


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed choice ``index`` of a request seeded with ``seed`` draws with (choice 0: ``seed`` itself,
    so n=1 and the first of n choices are the same draw)."""
    if seed is None or index == 0:
        return seed
    return (seed * 6_364_136_223_846_793_005 + index * 1_442_695_040_888_963_407) % (2**63 - 1)


def sibling_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s parameters: its own seed; one choice each; the prompt scored by choice 0 only."""
    return msgspec.structs.replace(params, seed=choice_seed(params.seed, index), n=1, best_of=None,
                                   prompt_logprobs=None)


_FLOAT32_MAX = 3.4028234663852886e38


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _check(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field}: {rule} (got {value!r})")


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    token_id: int
    logprob: float


class PromptLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of a prompt's tokens 1 .. P-1 (the first token has none), one entry per position.

    ``logprobs[i]``: of prompt token i + 1 given the tokens before it; ``ranks[i]``: its rank in that
    distribution (1: the most likely); ``top[i]``: the N most likely tokens there, most likely first."""

    logprobs: list[float] = msgspec.field(default_factory=list)
    ranks: list[int] = msgspec.field(default_factory=list)
    top: list[list[TokenLogprob]] = msgspec.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.logprobs)

    def truncate(self, num_positions: int) -> None:
        del self.logprobs[num_positions:], self.ranks[num_positions:], self.top[num_positions:]

    def extend(self, other: "PromptLogprobs") -> None:
        self.logprobs += other.logprobs
        self.ranks += other.ranks
        self.top += other.top


class CompletionOutput(msgspec.Struct, kw_only=True):
    """What one prompt produced."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # a FinishReason value, None while running
    logprobs: list[dict[int, float]] | None = None  # per generated token: id -> logprob (sampled + top N)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it, if any
    # with SamplingParams.prompt_logprobs: per prompt position, None for the first, then prompt token
    # id -> logprob and the top N (vLLM's shape)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    index: int = 0  # which choice of the request (n > 1)
    cumulative_logprob: float | None = None  # sum of the generated tokens' logprobs, when they were computed
    # n > 1 offline: every choice's output, in index order (this output is choices[0])
    choices: list["CompletionOutput"] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
