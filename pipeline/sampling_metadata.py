"""Per-request sampling state and the batch tensors the sampler builds from it each step.

``SequenceSamplingState`` is the engine-owned, long-lived view of one request that the sampler reads;
``SamplingMetadata`` is the per-step, per-batch translation of those states into padded tensors and
sparse (row, token) index lists, so that the sampler can process every row with a few vectorized ops.
Field names follow vLLM's / EasyDeL eSurge's sampling metadata vocabulary.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pipeline.protocol.requests import SamplingParams

# Temperatures below this are treated as greedy: dividing logits by them overflows fp32 and the
# resulting distribution is a one-hot on the argmax anyway (vLLM uses the same epsilon).
SAMPLING_EPS = 1e-5


@dataclass
class SequenceSamplingState:
    """Everything the sampler needs to know about one request; one per request, owned by the engine.

    The engine appends each sampled token to ``output_token_ids`` after every step. ``generator`` is
    created by the engine from ``params.seed`` (``None`` means "use the sampler's global generator"); it
    should live on the logits' device, otherwise each draw is moved there.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: set[int] = field(default_factory=set)
    # bad_words already tokenized by the engine (each word with and without a leading space)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    generator: torch.Generator | None = None
    # structured output: the request's GrammarMatcher (pipeline/structured_output), advanced by the engine
    grammar: Any = None

    @property
    def is_greedy(self) -> bool:
        return self.params.is_greedy or self.params.temperature < SAMPLING_EPS

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with no logits processor that can apply at this step: the raw argmax is the answer.

        Conservative (a bias on out-of-vocab ids only still counts), so ``False`` only costs speed.
        """
        p = self.params
        return (
            self.is_greedy
            and not p.logit_bias
            and p.allowed_token_ids is None
            and not self.bad_words_token_ids
            and len(self.output_token_ids) >= p.min_tokens
            and p.repetition_penalty == 1.0
            and not p.frequency_penalty
            and not p.presence_penalty
            and self.grammar is None
        )


@dataclass
class SamplingArrays:
    """The dense per-row sampling parameters of one step's rows: gathered from the persistent batch
    (``pipeline/sequence_buffer.py``, written once per request), or built from the states."""

    is_greedy: np.ndarray  # [num_rows] bool
    temperature: np.ndarray  # [num_rows] float32
    top_k: np.ndarray  # [num_rows] int64, vocab_size where disabled
    top_p: np.ndarray  # [num_rows] float32
    min_p: np.ndarray  # [num_rows] float32
    repetition_penalty: np.ndarray  # [num_rows] float32
    frequency_penalty: np.ndarray  # [num_rows] float32
    presence_penalty: np.ndarray  # [num_rows] float32

    FIELDS = ("is_greedy", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
              "presence_penalty")

    @staticmethod
    def row_values(state: SequenceSamplingState, vocab_size: int) -> tuple:
        """One request's values, in ``FIELDS`` order (top_k <= 0 or >= vocab both mean "off": vocab_size)."""
        p = state.params
        top_k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
        return (state.is_greedy, p.temperature, top_k, p.top_p, p.min_p, p.repetition_penalty,
                p.frequency_penalty, p.presence_penalty)

    @classmethod
    def from_states(cls, states: list[SequenceSamplingState], vocab_size: int) -> "SamplingArrays":
        columns = list(zip(*(cls.row_values(s, vocab_size) for s in states))) or [()] * len(cls.FIELDS)
        dtypes = (bool, np.float32, np.int64, np.float32, np.float32, np.float32, np.float32, np.float32)
        return cls(*(np.asarray(column, dtype=dtype) for column, dtype in zip(columns, dtypes)))


@dataclass
class SamplingMetadata:
    """One step's sampling inputs for a batch of ``num_rows`` rows, as tensors on the logits' device.

    Optional fields are ``None`` when no row in the batch uses that feature, so the sampler skips it.
    Tensors over "random rows" are indexed by position in ``random_rows`` (the non-greedy rows).
    """

    num_rows: int
    is_all_greedy: bool
    random_rows: torch.Tensor  # [num_random] int64, batch rows that sample (not greedy)
    random_generators: list[torch.Generator | None]  # [num_random], None = the sampler's global one
    temperature: torch.Tensor  # [num_random] fp32, all > 0
    top_k: torch.Tensor | None  # [num_random] int64, vocab_size where disabled
    max_top_k: int  # largest top_k over random rows (vocab_size if any row has it disabled)
    top_p: torch.Tensor | None  # [num_random] fp32, 1.0 where disabled
    min_p: torch.Tensor | None  # [num_random] fp32, 0.0 where disabled
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values) [num_biases]
    allowed_rows: torch.Tensor | None  # [num_allowed_rows] int64, rows that restrict their vocabulary
    disallowed_mask: torch.Tensor | None  # [num_allowed_rows, vocab] bool, True = not allowed
    banned_tokens: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) [num_bans], bad words + min_tokens
    repetition_penalty: torch.Tensor | None  # [num_rows, 1] fp32, 1.0 where disabled
    frequency_penalty: torch.Tensor | None  # [num_rows, 1] fp32, 0.0 where disabled
    presence_penalty: torch.Tensor | None  # [num_rows, 1] fp32, 0.0 where disabled
    output_tokens: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) [num_output_tokens], penalty rows only
    prompt_tokens: tuple[torch.Tensor, torch.Tensor] | None  # (rows, ids) [num_prompt_tokens], repetition rows only
    num_logprobs: list[int | None]  # [num_rows], None = this row did not ask for logprobs
    # structured output: (rows, packed int32 bitmask [num_grammar_rows, ceil(vocab / 32)]), the bitmask
    # possibly still being filled beside the forward (a Future: ``grammar_masks`` waits for it)
    grammar_bitmask: tuple[torch.Tensor, torch.Tensor | Future] | None = None

    def grammar_masks(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.grammar_bitmask is None:
            return None
        rows, bitmask = self.grammar_bitmask
        return rows, bitmask.result() if isinstance(bitmask, Future) else bitmask

    @property
    def needs_processing(self) -> bool:
        """Whether any logits processor (bias, masks, bans, penalties, grammars) applies to this batch."""
        return any(
            x is not None
            for x in (
                self.grammar_bitmask,
                self.logit_bias,
                self.allowed_rows,
                self.banned_tokens,
                self.repetition_penalty,
                self.frequency_penalty,
                self.presence_penalty,
            )
        )


def build_sampling_metadata(
    states: list[SequenceSamplingState], vocab_size: int, device: torch.device,
    arrays: SamplingArrays | None = None, mask_filler: Executor | None = None, masks_after: Future | None = None,
) -> SamplingMetadata:
    """Translate per-request states into one step's batch tensors; token ids outside the vocab are ignored.

    ``arrays``: the rows' dense parameters from the persistent batch (default: read from ``states``).
    ``mask_filler``: where grammar masks are filled (beside the forward); default: here, now.
    ``masks_after``: the fill waits for it (overlap: until the previous step's tokens are accepted)."""
    if arrays is None:
        arrays = SamplingArrays.from_states(states, vocab_size)
    params = [s.params for s in states]
    random_rows = np.flatnonzero(~arrays.is_greedy)
    top_ks = arrays.top_k[random_rows]
    top_ps = arrays.top_p[random_rows]
    min_ps = arrays.min_p[random_rows]

    def tensor(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values)).to(device)

    return SamplingMetadata(
        num_rows=len(states),
        is_all_greedy=random_rows.size == 0,
        random_rows=tensor(random_rows.astype(np.int64)),
        random_generators=[states[row].generator for row in random_rows.tolist()],
        temperature=tensor(arrays.temperature[random_rows]),
        top_k=tensor(top_ks) if (top_ks < vocab_size).any() else None,
        max_top_k=int(top_ks.max()) if top_ks.size else vocab_size,
        top_p=tensor(top_ps) if (top_ps < 1.0).any() else None,
        min_p=tensor(min_ps) if (min_ps > 0.0).any() else None,
        logit_bias=_logit_bias(params, vocab_size, device),
        **_allowed_tokens(params, vocab_size, device),
        banned_tokens=_banned_tokens(states, vocab_size, device),
        **_penalties(states, arrays, vocab_size, device),
        num_logprobs=[p.logprobs for p in params],
        grammar_bitmask=_grammar_bitmask(states, vocab_size, device, mask_filler, masks_after),
    )


def _grammar_bitmask(states: list[SequenceSamplingState], vocab_size: int, device: torch.device,
                     mask_filler: Executor | None,
                     masks_after: Future | None = None) -> tuple[torch.Tensor, torch.Tensor | Future] | None:
    """Each constrained row's allowed next tokens, from its matcher (the padded vocabulary tail is never
    allowed). With ``mask_filler`` the masks are filled there while the model runs: llguidance fills
    them without holding the interpreter lock, so on CPU they cost nothing beside the forward."""
    rows = [row for row, s in enumerate(states) if s.grammar is not None]
    if not rows:
        return None
    from pipeline.structured_output.backend import fill_bitmasks

    matchers = [states[row].grammar for row in rows]

    def fill() -> torch.Tensor:
        if masks_after is not None:
            masks_after.result()  # the matchers have taken the previous step's tokens
        bitmask = torch.zeros(len(rows), -(-vocab_size // 32), dtype=torch.int32)
        fill_bitmasks(matchers, bitmask)
        return bitmask.to(device)

    row_ids = torch.tensor(rows, dtype=torch.int64, device=device)
    if mask_filler is None and masks_after is not None:
        raise ValueError("masks_after needs a mask_filler to wait on")
    return row_ids, (mask_filler.submit(fill) if mask_filler is not None else fill())


def _logit_bias(
    params: list[SamplingParams], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows, token_ids, values = [], [], []
    for row, p in enumerate(params):
        for token_id, value in p.logit_bias.items():
            token_id = int(token_id)  # JSON object keys may arrive as strings
            if 0 <= token_id < vocab_size:
                rows.append(row)
                token_ids.append(token_id)
                values.append(float(value))
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(token_ids, dtype=torch.int64, device=device),
        torch.tensor(values, dtype=torch.float32, device=device),
    )


def _allowed_tokens(params: list[SamplingParams], vocab_size: int, device: torch.device) -> dict:
    rows = [row for row, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return dict(allowed_rows=None, disallowed_mask=None)
    disallowed = torch.ones(len(rows), vocab_size, dtype=torch.bool)  # [num_allowed_rows, vocab]
    for local_row, row in enumerate(rows):
        allowed = [t for t in params[row].allowed_token_ids if 0 <= t < vocab_size]
        disallowed[local_row, allowed] = False
    return dict(
        allowed_rows=torch.tensor(rows, dtype=torch.int64, device=device),
        disallowed_mask=disallowed.to(device),
    )


def _banned_tokens(
    states: list[SequenceSamplingState], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) whose logits become -inf this step: bad words and min_tokens stop ids."""
    banned: set[tuple[int, int]] = set()
    for row, s in enumerate(states):
        output = s.output_token_ids
        for word in s.bad_words_token_ids:
            if not word:
                continue
            prefix = word[:-1]
            # A multi-token word is only reachable through its prefix, so its last token is banned
            # exactly when the output ends with that prefix; a single-token word is always banned.
            if not prefix or (len(output) >= len(prefix) and output[-len(prefix):] == prefix):
                banned.add((row, word[-1]))
        if len(output) < s.params.min_tokens:
            # EOS is banned even with ignore_eos (as in vLLM): min_tokens promises no early stop token.
            for token_id in itertools.chain(s.params.stop_token_ids, s.eos_token_ids):
                banned.add((row, token_id))
    banned = {(row, t) for row, t in banned if 0 <= t < vocab_size}
    if not banned:
        return None
    rows, token_ids = zip(*sorted(banned))
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(token_ids, dtype=torch.int64, device=device),
    )


def _penalties(states: list[SequenceSamplingState], arrays: SamplingArrays, vocab_size: int,
               device: torch.device) -> dict:
    repetition, frequency, presence = arrays.repetition_penalty, arrays.frequency_penalty, arrays.presence_penalty
    repetition_rows = np.flatnonzero(repetition != 1.0).tolist()
    penalty_rows = np.flatnonzero((repetition != 1.0) | (frequency != 0.0) | (presence != 0.0)).tolist()

    def column(values: np.ndarray, is_used: bool) -> torch.Tensor | None:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(device)[:, None] if is_used else None

    return dict(
        repetition_penalty=column(repetition, bool(repetition_rows)),
        frequency_penalty=column(frequency, bool((frequency != 0.0).any())),
        presence_penalty=column(presence, bool((presence != 0.0).any())),
        output_tokens=_flat_tokens(states, penalty_rows, "output_token_ids", vocab_size, device),
        prompt_tokens=_flat_tokens(states, repetition_rows, "prompt_token_ids", vocab_size, device),
    )


def _flat_tokens(
    states: list[SequenceSamplingState], rows: list[int], attr: str, vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) of every token in ``attr`` of the given rows, flattened for a scatter-add."""
    token_lists = [getattr(states[row], attr) for row in rows]
    lengths = torch.tensor([len(tokens) for tokens in token_lists], dtype=torch.int64)  # [len(rows)]
    if int(lengths.sum()) == 0:
        return None
    token_ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64)  # [num_tokens]
    row_ids = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)  # [num_tokens]
    is_in_vocab = (token_ids >= 0) & (token_ids < vocab_size)
    return row_ids[is_in_vocab].to(device), token_ids[is_in_vocab].to(device)
