"""Sampler: turns one step's logits (one row per sampled sequence) into next tokens and logprobs.

Order of operations for each row, vectorized over the batch:

1. Logprobs from the RAW model logits (``log_softmax`` before any processing, as vLLM v1 returns
   by default): the sampled token plus the top-N, for rows with ``params.logprobs`` set. They are
   gathered after sampling, but from the untouched input logits.
2. Logits processing, on a copy of the logits, in this order:
   a. ``logit_bias`` added (token ids outside the vocab are ignored; the engine rejects them earlier);
   b. ``allowed_token_ids``: every other token gets -inf;
   c. bad words: single-token words always get -inf; a multi-token word's last token gets -inf when
      the output so far ends with the word's prefix;
   d. ``min_tokens``: while ``len(output) < min_tokens``, EOS ids and ``stop_token_ids`` get -inf;
   e. ``repetition_penalty`` (HF semantics, over prompt + output tokens): positive logits are
      divided by it, negative ones multiplied;
   f. ``frequency_penalty`` / ``presence_penalty`` (OpenAI semantics, over output tokens):
      ``logit -= frequency * count + presence * (count > 0)``.
   If a row's constraints mask every token, that row falls back to its raw logits rather than
   producing a meaningless token.
   g. structured output, last and never undone: tokens the row's grammar does not allow next get -inf
      (a packed int32 bitmask filled on the host from the request's matcher).
3. Greedy rows (``temperature == 0`` or ``top_k == 1``) take the argmax of the processed logits. Fast
   path: when every row is greedy and nothing needs processing, the raw logits' argmax is used (checked
   on the states first, so such a batch never builds the per-step metadata).
4. Other rows: divide by temperature, drop tokens with prob < min_p * max prob, keep the top_k largest,
   keep the smallest set whose cumulative probability (over what min_p and top_k kept) >= top_p (the top
   token always stays), then sample with the exponential race ``argmax(probs / Exp(1) noise)``. This is
   vLLM v1's order (min_p before top-k / top-p); transformers' ``generate`` applies min_p last.

Reproducibility: a seeded request draws its noise (one ``[vocab]`` draw per step on a non-greedy step)
from its own generator, so it samples the same tokens alone or batched with any other rows. Unseeded
rows share the sampler's global generator. Stop strings are the detokenizer's job, not the sampler's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from concurrent.futures import Executor, Future
from typing import Callable

import numpy as np
import torch

from pipeline.sampling_metadata import (SamplingArrays, SamplingMetadata, SequenceSamplingState,
                                        build_sampling_metadata)

__all__ = ["Sampler", "SamplerOutput", "SamplingPlan", "SequenceSamplingState", "sampling_probs", "step_seed"]


def step_seed(seed: int, position: int) -> int:
    """Seed of the draw for output token ``position`` of a request seeded with ``seed`` (any 64-bit integer).

    The two are mixed with splitmix64's finalizer and the high half folded into the low one, because torch's CPU
    generator (mt19937) keeps only the low 32 bits of a seed: without the fold, seeds 2**32 apart would draw the
    same tokens."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    x ^= x >> 31
    return (x ^ (x >> 32)) & (2**63 - 1)


@dataclass
class SamplerOutput:
    """One step's result, one entry per logits row."""

    token_ids: list[int]
    # Per row: {token id: logprob} holding the sampled token + top-N (N + 1 entries when the sampled
    # token is not among the top N), or None for rows that did not ask. None when no row asked.
    logprobs: list[dict[int, float] | None] | None
    token_tensor: torch.Tensor | None = None  # [num_rows] int64 on the logits' device: the next step's inputs


@dataclass
class SamplingPlan:
    """One step's sampling inputs, snapshotted from the requests' states: ``metadata`` is None when
    every row is plain greedy (the raw argmax is the answer)."""

    num_rows: int
    metadata: SamplingMetadata | None
    num_logprobs: list[int | None]


class Sampler:
    """Batched sampler over the flat batch's sampled rows; holds only the global generator(s)."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.seed = seed
        self._global_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, states: list[SequenceSamplingState]) -> SamplerOutput:
        """Sample one token per row. ``logits``: [num_rows, vocab] (fp32; other dtypes are upcast).

        ``states[i]`` describes row ``i``. The input tensor is never modified.
        """
        return self.sample(logits, self.plan(states, logits.device))

    def plan(self, states: list[SequenceSamplingState], device: torch.device,
             arrays: Callable[[], SamplingArrays] | None = None, mask_filler: Executor | None = None,
             masks_after: Future | None = None) -> SamplingPlan:
        """What a step's sampling needs from the requests' states, read now (the overlap pipeline reads
        them on the host at launch; the sampling itself may run later, on the execution stream).
        ``arrays()``: the rows' dense parameters from the persistent batch, asked only when needed;
        ``mask_filler``: where grammar masks are filled while the model runs, once ``masks_after`` is done."""
        if all(s.is_plain_greedy for s in states):
            return SamplingPlan(len(states), None, [s.params.logprobs for s in states])  # no metadata to build
        metadata = build_sampling_metadata(states, self.vocab_size, device, arrays() if arrays else None,
                                           mask_filler, masks_after)
        return SamplingPlan(len(states), metadata, metadata.num_logprobs)

    def sample(self, logits: torch.Tensor, plan: SamplingPlan) -> SamplerOutput:
        """Sample ``plan``'s rows from ``logits`` [num_rows, vocab]."""
        num_rows, vocab_size = logits.shape
        if num_rows != plan.num_rows:
            raise ValueError(f"got {num_rows} logits rows for {plan.num_rows} sampling states")
        if vocab_size != self.vocab_size:
            raise ValueError(f"logits have vocab {vocab_size}, sampler expects {self.vocab_size}")
        if num_rows == 0:
            return SamplerOutput(token_ids=[], logprobs=None)
        raw_logits = logits.float()  # [num_rows, vocab]
        metadata = plan.metadata
        if metadata is None or (metadata.is_all_greedy and not metadata.needs_processing):
            token_ids = raw_logits.argmax(dim=-1)  # [num_rows]
        else:
            processed = apply_logits_processing(raw_logits, metadata)  # [num_rows, vocab]
            token_ids = self._sample(processed, metadata)  # [num_rows]
        logprobs = gather_logprobs(raw_logits, token_ids, plan.num_logprobs)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs, token_tensor=token_ids)

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """[num_rows, vocab] processed logits -> [num_rows] int64 token ids."""
        token_ids = logits.argmax(dim=-1)  # [num_rows], final for greedy rows
        if metadata.is_all_greedy:
            return token_ids
        rows = metadata.random_rows
        probs = sampling_probs(logits, metadata)  # [num_random, vocab]
        noise = self._exponential_noise(metadata.random_generators, probs.shape[-1], probs.device)
        # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks token i with probability p_i
        # (no renormalization needed), and the draw depends only on the row's own generator.
        token_ids[rows] = (probs / noise).argmax(dim=-1)
        return token_ids

    def _exponential_noise(
        self, generators: list[torch.Generator | None], vocab_size: int, device: torch.device
    ) -> torch.Tensor:
        """[num_random, vocab] Exp(1) noise; seeded rows each draw one [vocab] sample from their own generator."""
        noise = torch.empty(len(generators), vocab_size, device=device)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if len(unseeded) == len(generators):
            noise.exponential_(generator=self.global_generator(device))
        elif unseeded:
            draw = torch.empty(len(unseeded), vocab_size, device=device)
            noise[unseeded] = draw.exponential_(generator=self.global_generator(device))
        for i, generator in enumerate(generators):
            if generator is not None:
                # A fresh [vocab] tensor on the generator's own device keeps the draw identical no
                # matter where the row sits in the batch.
                draw = torch.empty(vocab_size, device=generator.device).exponential_(generator=generator)
                noise[i] = draw.to(device)
        # Exp(1) can return exactly 0; a tiny floor avoids 0/0 on masked tokens.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    def global_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._global_generators:
            self._global_generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._global_generators[device]


def apply_logits_processing(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Bias, masks, bans and penalties (module docstring, step 2) -> a new [num_rows, vocab] tensor."""
    raw_logits = logits
    logits = logits.clone()  # [num_rows, vocab]
    neg_inf = torch.tensor(float("-inf"), device=logits.device)
    if metadata.logit_bias is not None:
        rows, token_ids, values = metadata.logit_bias
        logits.index_put_((rows, token_ids), values, accumulate=True)
    if metadata.allowed_rows is not None:
        rows = metadata.allowed_rows
        logits[rows] = logits[rows].masked_fill(metadata.disallowed_mask, float("-inf"))
    if metadata.banned_tokens is not None:
        logits.index_put_(metadata.banned_tokens, neg_inf)

    has_counts = metadata.frequency_penalty is not None or metadata.presence_penalty is not None
    if (has_counts or metadata.repetition_penalty is not None) and metadata.output_tokens is not None:
        counts = torch.zeros_like(logits)  # [num_rows, vocab], occurrences of each token in the output
        rows, token_ids = metadata.output_tokens
        counts.index_put_((rows, token_ids), torch.ones_like(token_ids, dtype=counts.dtype), accumulate=True)
    else:
        counts = None
    if metadata.repetition_penalty is not None:
        is_seen = counts > 0 if counts is not None else torch.zeros_like(logits, dtype=torch.bool)
        if metadata.prompt_tokens is not None:
            is_seen.index_put_(metadata.prompt_tokens, torch.tensor(True, device=logits.device))
        penalty = metadata.repetition_penalty  # [num_rows, 1]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(is_seen, penalized, logits)
    if counts is not None:
        if metadata.frequency_penalty is not None:
            logits -= metadata.frequency_penalty * counts
        if metadata.presence_penalty is not None:
            logits -= metadata.presence_penalty * (counts > 0)

    # Conflicting constraints (e.g. every allowed token is also a bad word) would leave no candidate;
    # the model's own distribution is a better answer than an arbitrary token 0.
    is_all_masked = torch.isneginf(logits).all(dim=-1, keepdim=True)  # [num_rows, 1]
    logits = torch.where(is_all_masked, raw_logits, logits)
    masks = metadata.grammar_masks()
    if masks is not None:  # last, and never undone: a grammar's mask is a hard constraint
        rows, bitmask = masks
        logits[rows] = apply_bitmask(logits[rows], bitmask)
    return logits


def sampling_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution each random row draws from (module docstring, step 4, before the draw):
    [num_rows, vocab] processed logits -> [num_random, vocab] probabilities of ``metadata.random_rows``."""
    return distribution(logits[metadata.random_rows], metadata.temperature, metadata.top_k, metadata.top_p,
                        metadata.min_p, metadata.max_top_k)


def distribution(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None, min_p: torch.Tensor | None, max_top_k: int) -> torch.Tensor:
    """[rows, vocab] logits -> [rows, vocab] probabilities after temperature [rows], min-p, top-k and top-p
    (each [rows] or None when no row uses it)."""
    scaled = logits / temperature[:, None]  # [rows, vocab]
    if min_p is not None:  # first, as vLLM v1 does: top-p then measures what min_p kept
        probs = scaled.softmax(dim=-1)  # [rows, vocab]
        max_probs = probs.amax(dim=-1, keepdim=True)  # [rows, 1]
        scaled = scaled.masked_fill(probs < min_p[:, None] * max_probs, float("-inf"))
    if top_k is not None or top_p is not None:
        scaled = apply_top_k_top_p(scaled, top_k, top_p, max_top_k)
    return scaled.softmax(dim=-1)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf where the packed int32 ``bitmask`` [rows, ceil(vocab / 32)] has bit ``t % 32`` of word ``t // 32`` clear."""
    vocab_size = logits.shape[-1]
    if logits.device.type == "cpu" and sys.byteorder == "little":
        # NumPy unpacks the bits in C: an int32's byte k holds bits 8k..8k+7, low bit first ("little")
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")
        is_blocked = torch.from_numpy(bits[:, :vocab_size] == 0)  # [rows, vocab]
    else:
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
        bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]: token t = word t // 32, bit t % 32
        is_blocked = bits.flatten(1)[:, :vocab_size] == 0  # [rows, vocab]
    return logits.masked_fill(is_blocked, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int
) -> torch.Tensor:
    """Mask [rows, vocab] logits outside each row's top_k [rows] and top_p [rows] (top-p on the top-k renormalized).

    ``max_top_k`` (the largest top_k of any row, vocab if a row has none) bounds the candidates: when every
    row uses top-k, a partial ``topk`` replaces the full-vocabulary sort, which dominates the cost otherwise.
    """
    vocab_size = logits.shape[-1]
    if max_top_k < vocab_size:
        sorted_logits, sorted_ids = logits.topk(max_top_k, dim=-1)  # [rows, max_top_k] each, descending
    else:
        sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [rows, vocab] each
    if top_k is not None:
        ranks = torch.arange(sorted_logits.shape[-1], device=logits.device)  # [num_candidates]
        sorted_logits.masked_fill_(ranks[None, :] >= top_k[:, None], float("-inf"))
    if top_p is not None:
        # Softmax over the candidates equals the top-k renormalized distribution: the rest are -inf anyway.
        sorted_probs = sorted_logits.softmax(dim=-1)  # [rows, num_candidates]
        # Probability mass strictly before each token; a token stays while that mass is < top_p, which
        # keeps the smallest prefix reaching top_p and always the top token (its mass before is 0).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits.masked_fill_(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, sorted_ids, sorted_logits)


def gather_logprobs(
    raw_logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int | None]
) -> list[dict[int, float] | None] | None:
    """Raw-logit logprobs of the sampled token + top-N for each row that asked; None if none asked."""
    rows = [row for row, n in enumerate(num_logprobs) if n is not None]
    if not rows:
        return None
    row_index = torch.tensor(rows, dtype=torch.int64, device=raw_logits.device)
    logprobs = raw_logits[row_index].log_softmax(dim=-1)  # [num_logprob_rows, vocab]
    sampled = logprobs.gather(-1, token_ids[row_index][:, None]).squeeze(-1).tolist()  # [num_logprob_rows]
    max_num = max(num_logprobs[row] for row in rows)
    if max_num > 0:
        top_values, top_ids = logprobs.topk(max_num, dim=-1)  # [num_logprob_rows, max_num] each
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    sampled_ids = token_ids[row_index].tolist()
    result: list[dict[int, float] | None] = [None] * len(num_logprobs)
    for i, row in enumerate(rows):
        entry = {sampled_ids[i]: sampled[i]}
        num = num_logprobs[row]
        for token_id, value in zip(top_ids[i][:num], top_values[i][:num]) if num else ():
            entry.setdefault(token_id, value)
        result[row] = entry
    return result
