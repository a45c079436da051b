"""Speculative-decoding verification keeps the target's distribution exactly: the first emitted token
(drafts that the target rules out and vice versa), no drafts at all, and the joint distribution of two
tokens under a toy Markov target and draft with k = 1 and 3, against the exact product and against
plain ancestral sampling. Fixed seeds, chi-square tests at the 0.001 level, enough trials that the
plausible bugs (always accepting, recovering from p instead of the residual, min(1, q/p)) fail."""

from __future__ import annotations

import pytest
import torch

from pipeline.speculative.rejection_sampler import rejection_sample
from tests.chi_square import assert_matches, assert_same_distribution
from tests.pipeline.test_rejection_sampler import seeded, token_counts

# ------------------------------------------------------------------------------- one-token exactness

# Target p and draft q over 5 tokens: q puts mass on token 4 where p has none, p puts mass on token 2
# where q has none, and they disagree elsewhere (token 0: 0.30 vs 0.05).
P_TARGET = torch.tensor([0.30, 0.25, 0.20, 0.25, 0.00])
Q_DRAFT = torch.tensor([0.05, 0.40, 0.00, 0.25, 0.30])


def speculate_one(p: torch.Tensor, q: torch.Tensor, p_bonus: torch.Tensor, num_trials: int,
                  seed: int) -> list[list[int]]:
    """``num_trials`` requests in one call, each with one draft sampled from ``q`` and target rows
    (p, p_bonus)."""
    drafts = torch.multinomial(q, num_trials, replacement=True, generator=seeded(seed))  # [num_trials]
    target_probs = torch.stack([p, p_bonus]).repeat(num_trials, 1)  # [2 * num_trials, vocab]
    return rejection_sample(
        target_probs=target_probs,
        target_argmax=target_probs.argmax(dim=-1),
        draft_probs=q.expand(num_trials, -1),
        draft_token_ids=drafts,
        num_draft_tokens=[1] * num_trials,
        is_greedy=[False] * num_trials,
        generators=[None] * (2 * num_trials),
        global_generator=seeded(seed + 1),
    )


def test_first_token_is_distributed_as_target():
    num_trials = 40_000
    p_bonus = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.6])
    outputs = speculate_one(P_TARGET, Q_DRAFT, p_bonus, num_trials, seed=1)
    first = token_counts([out[0] for out in outputs], vocab=5)
    assert_matches(first, P_TARGET)  # also asserts token 4 (p = 0) never appears
    # The acceptance rate is sum(min(p, q)) = 0.05 + 0.25 + 0 + 0.25 + 0 = 0.55.
    accepted = sum(len(out) == 2 for out in outputs) / num_trials
    assert abs(accepted - 0.55) < 0.02
    # After an accepted draft, the bonus token is a plain sample from the bonus row.
    bonus = token_counts([out[1] for out in outputs if len(out) == 2], vocab=5)
    assert_matches(bonus, p_bonus)


def test_no_drafts_samples_from_target():
    vocab, num_requests = 5, 10_000
    target_probs = P_TARGET.expand(num_requests, -1)
    outputs = rejection_sample(target_probs, target_probs.argmax(dim=-1), torch.zeros(0, vocab),
                               torch.zeros(0, dtype=torch.int64), [0] * num_requests, [False] * num_requests,
                               [None] * num_requests, seeded(3))
    assert all(len(out) == 1 for out in outputs)
    assert_matches(token_counts([out[0] for out in outputs], vocab), P_TARGET)


# ----------------------------------------------------------------------------- multi-token exactness

# A toy language model over 5 tokens: row = previous token, column = next token. The sequences start
# from token 0. The draft disagrees with the target everywhere, including zeros on both sides.
P_MARKOV = torch.tensor([
    [0.10, 0.40, 0.30, 0.20, 0.00],
    [0.30, 0.00, 0.30, 0.20, 0.20],
    [0.25, 0.25, 0.25, 0.00, 0.25],
    [0.00, 0.50, 0.10, 0.20, 0.20],
    [0.40, 0.10, 0.10, 0.10, 0.30],
])
Q_MARKOV = torch.tensor([
    [0.40, 0.10, 0.00, 0.20, 0.30],
    [0.10, 0.50, 0.10, 0.20, 0.10],
    [0.05, 0.05, 0.60, 0.20, 0.10],
    [0.30, 0.00, 0.30, 0.20, 0.20],
    [0.10, 0.40, 0.10, 0.30, 0.10],
])
START = 0


def speculative_prefixes(num_trials: int, num_tokens: int, k: int, seed: int) -> torch.Tensor:
    """Run speculative decoding of ``P_MARKOV`` with drafts from ``Q_MARKOV`` (``k`` per step), all trials
    batched in one call per step, until each has ``num_tokens`` tokens. Returns [num_trials, num_tokens]."""
    draft_gen, verify_gen = seeded(seed), seeded(seed + 1)
    outputs: list[list[int]] = [[] for _ in range(num_trials)]
    active = list(range(num_trials))
    while active:
        last = torch.tensor([outputs[i][-1] if outputs[i] else START for i in active])  # [n]
        # Draft k tokens autoregressively from q; q_j is the draft's distribution given the prefix.
        contexts, drafts = [last], []
        for _ in range(k):
            drafts.append(torch.multinomial(Q_MARKOV[contexts[-1]], 1, generator=draft_gen).squeeze(1))
            contexts.append(drafts[-1])
        # Per request: target rows p(.|last), p(.|d_0), .., p(.|d_{k-1}) (the last one is the bonus row).
        target_probs = torch.stack([P_MARKOV[c] for c in contexts], dim=1).reshape(-1, 5)  # [n * (k + 1), 5]
        draft_probs = torch.stack([Q_MARKOV[c] for c in contexts[:k]], dim=1).reshape(-1, 5)  # [n * k, 5]
        draft_ids = torch.stack(drafts, dim=1).reshape(-1)  # [n * k]
        emitted = rejection_sample(target_probs, target_probs.argmax(dim=-1), draft_probs, draft_ids,
                                   [k] * len(active), [False] * len(active), [None] * len(target_probs),
                                   verify_gen)
        for i, tokens in zip(active, emitted):
            outputs[i].extend(tokens)
        active = [i for i in active if len(outputs[i]) < num_tokens]
    return torch.tensor([out[:num_tokens] for out in outputs])


def direct_prefixes(num_trials: int, seed: int) -> torch.Tensor:
    """Plain ancestral sampling of two tokens from the target. Returns [num_trials, 2]."""
    gen = seeded(seed)
    first = torch.multinomial(P_MARKOV[START], num_trials, replacement=True, generator=gen)  # [num_trials]
    second = torch.multinomial(P_MARKOV[first], 1, generator=gen).squeeze(1)  # [num_trials]
    return torch.stack([first, second], dim=1)


def pair_counts(pairs: torch.Tensor) -> torch.Tensor:
    return torch.bincount(pairs[:, 0] * 5 + pairs[:, 1], minlength=25)  # [25], cell = (t1, t2)


@pytest.mark.parametrize("k", [1, 3])  # k = 1: token 2 is often the bonus; k = 3: often a second draft
def test_two_token_joint_distribution_is_exact(k: int):
    num_trials = 20_000
    speculative = pair_counts(speculative_prefixes(num_trials, num_tokens=2, k=k, seed=5))
    direct = pair_counts(direct_prefixes(num_trials, seed=6))
    exact = (P_MARKOV[START][:, None] * P_MARKOV).flatten()  # [25]: p(t1 | start) * p(t2 | t1)
    assert_matches(speculative, exact)
    assert_matches(direct, exact)  # the harness itself is sound
    assert_same_distribution(speculative, direct)
