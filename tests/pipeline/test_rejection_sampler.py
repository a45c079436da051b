"""Speculative-decoding verification: greedy rules, seeded reproducibility by output position, draw
order, and the q(d) = 0 / p(d) = 0 / p == q edge cases. That the target's distribution is kept exactly:
``tests/pipeline/test_rejection_sampler_distribution.py``."""

from __future__ import annotations

import pytest
import torch

from pipeline.speculative.rejection_sampler import _accept, rejection_sample
from tests.chi_square import assert_matches

# ----------------------------------------------------------------------------------------------- helpers

def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def row_generators(seed: int, num_rows: int) -> list[torch.Generator]:
    """One generator per target row, seeded from (request seed, output position) as the caller does."""
    return [seeded(seed * 1000 + position) for position in range(num_rows)]


def token_counts(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=vocab)  # [vocab]


def random_probs(num_rows: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return (torch.randn(num_rows, vocab, generator=seeded(seed)) * scale).softmax(dim=-1)  # [num_rows, vocab]


# ---------------------------------------------------------------------------------------------- greedy

def greedy_call(target_argmax: list[int], drafts: list[int], num_draft_tokens: list[int]) -> list[list[int]]:
    """Greedy requests only: the probability rows are not read, so they are zeros here."""
    vocab = 16
    return rejection_sample(
        target_probs=torch.zeros(len(target_argmax), vocab),
        target_argmax=torch.tensor(target_argmax, dtype=torch.int64),
        draft_probs=torch.zeros(len(drafts), vocab),
        draft_token_ids=torch.tensor(drafts, dtype=torch.int64),
        num_draft_tokens=num_draft_tokens,
        is_greedy=[True] * len(num_draft_tokens),
        generators=[None] * len(target_argmax),
    )


def test_greedy_all_accepted_ends_with_bonus_argmax():
    assert greedy_call([3, 5, 7, 9], [3, 5, 7], [3]) == [[3, 5, 7, 9]]


def test_greedy_first_mismatch_emits_target_token_and_stops():
    assert greedy_call([3, 5, 7, 9], [3, 6, 7], [3]) == [[3, 5]]
    assert greedy_call([3, 5, 7, 9], [4, 5, 7], [3]) == [[3]]
    assert greedy_call([3, 5, 7, 9], [3, 5, 8], [3]) == [[3, 5, 7]]


def test_greedy_without_drafts_emits_argmax():
    assert greedy_call([11], [], [0]) == [[11]]


def test_greedy_several_requests_with_different_k():
    # Requests: k=2 all match; k=0; k=3 mismatch at 1; k=1 mismatch at 0 (emits the target's 9).
    target_argmax = [1, 2, 3] + [4] + [5, 6, 7, 8] + [9, 10]
    drafts = [1, 2] + [] + [5, 0, 7] + [1]
    assert greedy_call(target_argmax, drafts, [2, 0, 3, 1]) == [[1, 2, 3], [4], [5, 6], [9]]


def test_greedy_and_sampling_requests_mixed():
    vocab = 4
    p = torch.tensor([0.0, 1.0, 0.0, 0.0])  # the sampling request's target is a point mass: always token 1
    target_probs = torch.stack([torch.zeros(vocab), torch.zeros(vocab), p, p])  # greedy k=1 rows, then sampled k=1
    draft_probs = torch.stack([torch.zeros(vocab), torch.tensor([0.5, 0.5, 0.0, 0.0])])
    out = rejection_sample(target_probs, torch.tensor([2, 3, 1, 1]), draft_probs, torch.tensor([2, 0]),
                           [1, 1], [True, False], [None] * 4, seeded(0))
    assert out == [[2, 3], [1]]  # greedy: accepted + bonus; sampled: draft 0 has p = 0, recovery is token 1


# ---------------------------------------------------------------------------------- reproducibility

VOCAB = 32


def request_tensors(seed: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sampling request's (target rows [k + 1, V], draft rows [k, V], drafts [k]); drafts come from q."""
    p = random_probs(k + 1, VOCAB, seed)
    # A draft close enough to p that some requests accept several tokens, far enough that some reject.
    q = (0.5 * p[:k] + 0.5 * random_probs(k, VOCAB, seed + 10_000))
    drafts = torch.multinomial(q, 1, generator=seeded(seed + 20_000)).squeeze(1)
    return p, q, drafts


def run_requests(requests: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]],
                 global_seed: int = 99) -> list[list[int]]:
    """``requests``: (target rows, draft rows, drafts, per-row generators) each, verified in one call."""
    target_probs = torch.cat([r[0] for r in requests])
    return rejection_sample(
        target_probs=target_probs,
        target_argmax=target_probs.argmax(dim=-1),
        draft_probs=torch.cat([r[1] for r in requests]),
        draft_token_ids=torch.cat([r[2] for r in requests]),
        num_draft_tokens=[len(r[2]) for r in requests],
        is_greedy=[False] * len(requests),
        generators=[g for r in requests for g in r[3]],
        global_generator=seeded(global_seed),
    )


def test_seeded_request_is_reproducible_alone_or_batched():
    k = 4
    lengths = set()
    for seed in range(40):
        p, q, drafts = request_tensors(seed, k)
        b_p, b_q, b_drafts = request_tensors(seed + 500, 2)
        alone = run_requests([(p, q, drafts, row_generators(seed, k + 1))])[0]
        assert run_requests([(p, q, drafts, row_generators(seed, k + 1))])[0] == alone
        # Another request before it (seeded or not) shifts its rows but changes nothing.
        assert run_requests([(b_p, b_q, b_drafts, row_generators(seed + 500, 3)),
                             (p, q, drafts, row_generators(seed, k + 1))])[1] == alone
        assert run_requests([(b_p, b_q, b_drafts, [None] * 3),
                             (p, q, drafts, row_generators(seed, k + 1))])[1] == alone
        lengths.add(len(alone))
    assert len(lengths) >= 3, f"the seeds should cover early rejections and full acceptance: {lengths}"


def test_unseeded_request_is_unaffected_by_seeded_neighbours():
    k = 3
    for seed in range(10):
        p, q, drafts = request_tensors(seed, k)
        a_p, a_q, a_drafts = request_tensors(seed + 500, k)
        alone = run_requests([(p, q, drafts, [None] * (k + 1))], global_seed=seed)[0]
        batched = run_requests([(a_p, a_q, a_drafts, row_generators(seed, k + 1)),
                                (p, q, drafts, [None] * (k + 1))], global_seed=seed)[1]
        assert batched == alone


def test_different_seeds_give_different_samples():
    p, q, drafts = request_tensors(0, 3)
    outputs = {tuple(run_requests([(p, q, drafts, row_generators(seed, 4))])[0]) for seed in range(30)}
    assert len(outputs) > 5


def test_rows_after_the_rejection_do_not_matter():
    """The output is reproducible by position: generators of rows past the emitted token are irrelevant."""
    k = 4
    checked = 0
    for seed in range(40):
        p, q, drafts = request_tensors(seed, k)
        out = run_requests([(p, q, drafts, row_generators(seed, k + 1))])[0]
        if len(out) == k + 1:
            continue
        used = len(out)  # rows 0 .. len(out) - 1 decided the output
        generators = row_generators(seed, k + 1)[:used] + row_generators(seed + 777, k + 1)[used:]
        assert run_requests([(p, q, drafts, generators)])[0] == out
        checked += 1
    assert checked >= 5


def test_draw_order_per_row():
    """Row j's generator gives first the uniform (drafted rows), then the [vocab] exponential noise."""
    vocab = 8
    tiny = torch.finfo(torch.float32).tiny
    # Recovery at row 0: p(d) = 0 forces the rejection; the token is the race over max(0, p - q).
    p = random_probs(2, vocab, seed=1)
    p[0, 3] = 0.0
    p[0] /= p[0].sum()
    q = random_probs(1, vocab, seed=2)
    for seed in range(20):
        out = run_requests([(p, q, torch.tensor([3]), [seeded(seed), seeded(seed + 100)])])[0]
        replay = seeded(seed)
        torch.rand((), generator=replay)  # the uniform comes first
        noise = torch.empty(vocab).exponential_(generator=replay).clamp_min(tiny)
        assert out == [int(((p[0] - q[0]).clamp_min(0) / noise).argmax())]
    # Bonus at row 2 (p == q: both drafts accepted): the bonus row draws no uniform, only the noise.
    p = random_probs(3, vocab, seed=3)
    for seed in range(20):
        drafts = torch.multinomial(p[:2], 1, generator=seeded(seed)).squeeze(1)
        out = run_requests([(p, p[:2].clone(), drafts, row_generators(seed, 3))])[0]
        noise = torch.empty(vocab).exponential_(generator=row_generators(seed, 3)[2]).clamp_min(tiny)
        assert out == drafts.tolist() + [int((p[2] / noise).argmax())]


def replay(p: torch.Tensor, q: torch.Tensor, drafts: list[int], generators: list[torch.Generator]) -> list[int]:
    """The documented contract, one scalar step at a time: row j's generator gives u_j, then, on the row
    that emits a sampled token, the [vocab] Exp(1) noise for the race."""
    tiny = torch.finfo(torch.float32).tiny
    for j, draft in enumerate(drafts):
        u = torch.rand((), generator=generators[j]).item()
        if not (p[j, draft] > 0 and u * q[j, draft] <= p[j, draft]):
            residual = (p[j] - q[j]).clamp_min(0)
            noise = torch.empty(p.shape[1]).exponential_(generator=generators[j]).clamp_min(tiny)
            return drafts[:j] + [int((residual / noise).argmax())]
    noise = torch.empty(p.shape[1]).exponential_(generator=generators[len(drafts)]).clamp_min(tiny)
    return drafts + [int((p[len(drafts)] / noise).argmax())]


def test_every_row_draws_from_its_own_generator():
    k = 3
    lengths = set()
    for seed in range(60):
        p, q, drafts = request_tensors(seed, k)
        out = run_requests([(p, q, drafts, row_generators(seed, k + 1))])[0]
        assert out == replay(p, q, drafts.tolist(), row_generators(seed, k + 1))
        lengths.add(len(out))
    assert lengths == {1, 2, 3, 4}, f"the seeds should reach every row: {lengths}"


# ------------------------------------------------------------------------------------------ edge cases

def one_draft_many_times(p: torch.Tensor, q: torch.Tensor, draft: int, num_trials: int,
                         seed: int) -> list[list[int]]:
    """``num_trials`` identical requests (target rows (p, p), draft row q, the given draft), one call."""
    target_probs = p.expand(2 * num_trials, -1)
    return rejection_sample(target_probs, target_probs.argmax(dim=-1), q.expand(num_trials, -1),
                            torch.full((num_trials,), draft, dtype=torch.int64), [1] * num_trials,
                            [False] * num_trials, [None] * (2 * num_trials), seeded(seed))


def test_draft_with_zero_draft_probability_is_accepted():
    p = torch.tensor([0.1, 0.6, 0.3, 0.0])
    q = torch.tensor([0.0, 0.2, 0.3, 0.5])  # q(0) = 0 < p(0)
    outputs = one_draft_many_times(p, q, draft=0, num_trials=2000, seed=0)
    assert all(len(out) == 2 and out[0] == 0 for out in outputs)


def test_draft_the_target_rules_out_is_always_rejected():
    p = torch.tensor([0.0, 0.5, 0.5, 0.0])
    q = torch.tensor([0.5, 0.5, 0.0, 0.0])
    outputs = one_draft_many_times(p, q, draft=0, num_trials=2000, seed=0)
    # Residual max(0, p - q) = (0, 0, 0.5, 0): the recovery token is always 2, never the draft.
    assert outputs == [[2]] * 2000
    # Even a uniform of exactly 0 does not accept a token with p = 0; q = 0 with p > 0 does accept.
    accepted = _accept(torch.tensor([0.0, 0.0, 0.999]), torch.tensor([0.0, 0.3, 0.3]), torch.tensor([0.4, 0.0, 0.0]))
    assert accepted.tolist() == [False, True, True]


def test_identical_draft_and_target_always_accept():
    k, num_requests = 3, 300
    p = random_probs(num_requests * (k + 1), VOCAB, seed=4)  # [num_requests * (k + 1), V]
    drafted_rows = p.reshape(num_requests, k + 1, VOCAB)[:, :k].reshape(-1, VOCAB)  # [num_requests * k, V]
    drafts = torch.multinomial(drafted_rows, 1, generator=seeded(5)).squeeze(1)
    outputs = rejection_sample(p, p.argmax(dim=-1), drafted_rows.clone(), drafts, [k] * num_requests,
                               [False] * num_requests, [None] * len(p), seeded(6))
    assert [out[:k] for out in outputs] == drafts.reshape(num_requests, k).tolist()
    assert all(len(out) == k + 1 for out in outputs)


def test_identical_draft_and_target_rejection_falls_back_to_target():
    # p == q and the draft has p(d) = q(d) = 0: rejected, the residual is all zero, so the recovery token
    # is sampled from p itself.
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    outputs = one_draft_many_times(p, p, draft=3, num_trials=10_000, seed=7)
    assert all(len(out) == 1 for out in outputs)
    assert_matches(token_counts([out[0] for out in outputs], vocab=4), p)


def test_shape_mismatches_are_rejected():
    p = torch.full((2, 4), 0.25)
    args = dict(target_probs=p, target_argmax=torch.zeros(2, dtype=torch.int64), draft_probs=p[:1],
                draft_token_ids=torch.zeros(1, dtype=torch.int64), num_draft_tokens=[1], is_greedy=[False],
                generators=[None, None])
    assert rejection_sample(**args)  # consistent: fine
    for key, bad in [("num_draft_tokens", [2]), ("is_greedy", [False, True]), ("generators", [None]),
                     ("draft_probs", p), ("draft_token_ids", torch.zeros(2, dtype=torch.int64)),
                     ("target_argmax", torch.zeros(3, dtype=torch.int64))]:
        with pytest.raises(ValueError):
            rejection_sample(**{**args, key: bad})


def test_the_coupled_path_emits_the_targets_own_draws_and_keeps_drafts_equal_to_them():
    """A seeded request: each row's token is the exponential race of its own (position) generator on the
    target's weights, the draw sampling without a draft makes; drafts are kept while they equal it."""
    from pipeline.speculative.seeds import position_generator

    vocab, k = 50, 3
    weights = torch.rand(k + 1, vocab, generator=torch.Generator().manual_seed(0)) ** 4  # unnormalized, as raced

    def generators():
        return [position_generator(1234, 10 + j, torch.device("cpu")) for j in range(k + 1)]

    own = [int((weights[j] / torch.empty(vocab).exponential_(generator=g).clamp_min_(torch.finfo(torch.float32).tiny))
               .argmax()) for j, g in enumerate(generators())]

    def run(drafts):
        return rejection_sample(weights, weights.argmax(dim=-1), torch.zeros(k, vocab),
                                torch.tensor(drafts, dtype=torch.int64), [k], [False], generators(),
                                is_coupled=[True])[0]

    assert run(own[:k]) == own  # every draft is the target's draw: all kept, then the bonus draw
    wrong = (own[1] + 1) % vocab
    assert run([own[0], wrong, own[2]]) == [own[0], own[1]]  # the first that differs is replaced, the rest dropped
    assert run([(own[0] + 1) % vocab, own[1], own[2]]) == [own[0]]
