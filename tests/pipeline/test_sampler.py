"""Sampler: each sampling parameter changes the outcome, seeds reproduce, logprobs come from raw logits."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.protocol.requests import SamplingParams
from pipeline.sampler import Sampler, SequenceSamplingState

VOCAB = 64


def state(prompt=(1, 2, 3), output=(), eos=(0,), bad_words=(), seed=None, **params) -> SequenceSamplingState:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SequenceSamplingState(
        params=SamplingParams(seed=seed, **params),
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        eos_token_ids=set(eos),
        bad_words_token_ids=[list(w) for w in bad_words],
        generator=generator,
    )


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3  # [num_rows, VOCAB]


def peaked_logits(top: int, runner_up: int | None = None, num_rows: int = 1) -> torch.Tensor:
    """Logits whose argmax is ``top`` by a wide margin, with ``runner_up`` a clear second."""
    logits = torch.zeros(num_rows, VOCAB)
    logits[:, top] = 10.0
    if runner_up is not None:
        logits[:, runner_up] = 8.0
    return logits


def sample_one(logits: torch.Tensor, s: SequenceSamplingState, seed: int = 0) -> int:
    return Sampler(VOCAB, seed=seed)(logits, [s]).token_ids[0]


def greedy(**kwargs) -> SequenceSamplingState:
    return state(temperature=0.0, **kwargs)


# --- greedy -------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = random_logits(8)
    out = Sampler(VOCAB)(logits, [greedy() for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_top_k_one_is_greedy_even_at_temperature_one():
    logits = random_logits(8, seed=1) / 3  # flat enough that real sampling would leave the argmax
    out = Sampler(VOCAB)(logits, [state(temperature=1.0, top_k=1) for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_input_logits_are_not_modified():
    logits = random_logits(2)
    before = logits.clone()
    Sampler(VOCAB)(logits, [greedy(logit_bias={5: 50.0}), state(repetition_penalty=2.0)])
    assert torch.equal(logits, before)


# --- seeds --------------------------------------------------------------------------------------


def run_steps(make_batch, row: int, num_steps: int = 6) -> list[int]:
    """Run ``num_steps`` steps with fresh logits each step; return the tokens of batch row ``row``."""
    states = make_batch()
    sampler = Sampler(VOCAB, seed=123)
    tokens = []
    for step in range(num_steps):
        logits = random_logits(1, seed=100 + step).expand(len(states), VOCAB) / 3  # same logits every row
        out = sampler(logits, states)
        for s, t in zip(states, out.token_ids):
            s.output_token_ids.append(t)
        tokens.append(out.token_ids[row])
    return tokens


def test_seeded_request_same_alone_and_in_batch():
    alone = run_steps(lambda: [state(seed=7)], row=0, num_steps=8)
    batched = run_steps(
        lambda: [state(), state(seed=99, top_p=0.9), state(seed=7), greedy(), state(seed=3, top_k=5)],
        row=2,
        num_steps=8,
    )
    assert alone == batched


def test_different_seeds_differ():
    a = run_steps(lambda: [state(seed=1)], row=0, num_steps=10)
    b = run_steps(lambda: [state(seed=2)], row=0, num_steps=10)
    assert a != b


# --- logits processing: each parameter must change the outcome ----------------------------------


def test_logit_bias():
    logits = peaked_logits(top=5)
    assert sample_one(logits, greedy()) == 5
    assert sample_one(logits, greedy(logit_bias={9: 20.0})) == 9
    assert sample_one(logits, greedy(logit_bias={VOCAB + 10: 20.0})) == 5  # out of range: ignored


def test_allowed_token_ids():
    logits = peaked_logits(top=5, runner_up=6)
    assert sample_one(logits, greedy(allowed_token_ids=[6, 30])) == 6
    sampled = {sample_one(random_logits(1, seed=s) / 3, state(allowed_token_ids=[11, 12]), seed=s) for s in range(30)}
    assert sampled <= {11, 12}


def test_bad_words_single_token_always_banned():
    logits = peaked_logits(top=5, runner_up=6)
    assert sample_one(logits, greedy(bad_words=[[5]])) == 6


def test_bad_words_multi_token_bans_last_token_only_after_prefix():
    logits = peaked_logits(top=5, runner_up=6)
    word = [20, 21, 5]
    assert sample_one(logits, greedy(output=[3, 20, 21], bad_words=[word])) == 6
    assert sample_one(logits, greedy(output=[3, 20], bad_words=[word])) == 5  # prefix incomplete
    assert sample_one(logits, greedy(output=[21, 20], bad_words=[word])) == 5  # wrong order
    assert sample_one(logits, greedy(prompt=[20, 21], bad_words=[word])) == 5  # prefix must be in the output


def test_min_tokens_bans_eos_and_stop_token_ids():
    logits = peaked_logits(top=0, runner_up=7)  # EOS (0) is the argmax, stop id 7 the runner-up
    logits[0, 8] = 6.0
    s = greedy(eos=[0], stop_token_ids=[7], min_tokens=3, output=[4, 4])
    assert sample_one(logits, s) == 8
    s.output_token_ids.append(4)  # min_tokens reached: EOS allowed again
    assert sample_one(logits, s) == 0


def test_repetition_penalty_uses_prompt_and_output():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 4.0, 3.0
    assert sample_one(logits, greedy(prompt=[5])) == 5
    assert sample_one(logits, greedy(prompt=[5], repetition_penalty=2.0)) == 6  # 4 / 2 < 3
    assert sample_one(logits, greedy(prompt=[1], output=[5], repetition_penalty=2.0)) == 6
    # Negative logits are multiplied: a seen token at -1 sinks below an unseen one at -1.5.
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 5], logits[0, 6] = -1.0, -1.5
    assert sample_one(logits, greedy(prompt=[5], repetition_penalty=2.0)) == 6


def test_frequency_penalty_counts_occurrences():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 4.0, 3.0
    # Seen once: 4 - 0.8 = 3.2 still wins; seen twice: 4 - 1.6 = 2.4 loses.
    assert sample_one(logits, greedy(output=[5], frequency_penalty=0.8)) == 5
    assert sample_one(logits, greedy(output=[5, 5], frequency_penalty=0.8)) == 6
    assert sample_one(logits, greedy(prompt=[5, 5], frequency_penalty=0.8)) == 5  # output tokens only


def test_presence_penalty_is_flat():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 4.0, 3.0
    assert sample_one(logits, greedy(output=[5], presence_penalty=1.5)) == 6
    # Presence does not grow with the count: 4 - 0.8 = 3.2 beats 3 however often 5 was seen.
    assert sample_one(logits, greedy(output=[5] * 5, presence_penalty=0.8)) == 5


def test_penalties_apply_per_row():
    logits = torch.zeros(2, VOCAB)
    logits[:, 5], logits[:, 6] = 4.0, 3.0
    out = Sampler(VOCAB)(logits, [greedy(output=[5], presence_penalty=2.0), greedy(output=[5])])
    assert out.token_ids == [6, 5]


def test_conflicting_constraints_fall_back_to_raw_logits():
    logits = peaked_logits(top=5)
    assert sample_one(logits, greedy(allowed_token_ids=[9], bad_words=[[9]])) == 5


# --- sampling filters ---------------------------------------------------------------------------


def sample_many(logits: torch.Tensor, num: int = 400, **params) -> list[int]:
    """``num`` draws from one request's distribution, batched as ``num`` unseeded rows."""
    out = Sampler(VOCAB, seed=0)(logits.expand(num, VOCAB), [state(**params) for _ in range(num)])
    return out.token_ids


def three_way_logits() -> torch.Tensor:
    """Probabilities about 0.5 / 0.3 / 0.2 on tokens 1 / 2 / 3, ~0 elsewhere."""
    logits = torch.full((1, VOCAB), -30.0)
    logits[0, 1:4] = torch.tensor([0.5, 0.3, 0.2]).log()
    return logits


def test_top_k_keeps_k_largest():
    assert set(sample_many(three_way_logits())) == {1, 2, 3}
    assert set(sample_many(three_way_logits(), top_k=2)) == {1, 2}


def test_top_p_keeps_smallest_set_reaching_p():
    assert set(sample_many(three_way_logits(), top_p=0.7)) == {1, 2}  # 0.5 < 0.7 <= 0.8
    assert set(sample_many(three_way_logits(), top_p=0.85)) == {1, 2, 3}  # 0.8 < 0.85: token 3 is needed
    assert set(sample_many(three_way_logits(), top_p=0.3)) == {1}  # the top token always stays


def test_top_p_applies_to_the_top_k_renormalized():
    # Within the top 2, probabilities become 0.625 / 0.375, so top_p=0.6 keeps token 1 alone
    # (on the unrenormalized 0.5 / 0.3 it would keep both).
    assert set(sample_many(three_way_logits(), top_k=2, top_p=0.6)) == {1}


def test_top_k_rows_mixed_with_unfiltered_rows():
    logits = three_way_logits().expand(400, VOCAB)
    tokens = Sampler(VOCAB)(logits, [state(top_k=2) if i % 2 else state() for i in range(400)]).token_ids
    assert set(tokens[1::2]) == {1, 2}
    assert set(tokens[0::2]) == {1, 2, 3}


def test_min_p_drops_relatively_unlikely_tokens():
    assert set(sample_many(three_way_logits(), min_p=0.5)) == {1, 2}  # 0.2 < 0.5 * 0.5


def test_min_p_comes_before_top_p_as_in_vllm():
    """vLLM v1: temperature, then min_p, then top-k / top-p over what min_p kept (renormalized)."""
    logits = torch.full((1, VOCAB), -40.0)
    logits[0, :6] = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]).log()
    # min_p 0.3 keeps p >= 0.12: 0.4 / 0.25 / 0.15, renormalized 0.5 / 0.31 / 0.19; top_p 0.8 then keeps two
    # (over the whole distribution first, top_p 0.8 would keep three and min_p all of them)
    assert set(sample_many(logits, min_p=0.3, top_p=0.8)) == {0, 1}
    assert set(sample_many(logits, min_p=0.3, top_k=5)) == {0, 1, 2}


def test_temperature_sharpens_and_flattens():
    low = sample_many(three_way_logits(), temperature=0.1)
    high = sample_many(three_way_logits(), temperature=5.0)
    assert low.count(1) > 0.97 * len(low)  # p(1) = 0.5^10 / (...) ~ 0.99
    assert 0.25 < high.count(1) / len(high) < 0.45  # nearly uniform over 3 tokens: ~0.37


def test_sampling_follows_distribution():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = torch.full((1, VOCAB), -40.0)
    logits[0, : len(probs)] = probs.log()
    tokens = sample_many(logits, num=4000)
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).float() / len(tokens)
    assert counts[len(probs):].sum() == 0
    assert torch.allclose(counts[: len(probs)], probs, atol=0.03), counts[: len(probs)]


def test_filters_apply_per_row():
    logits = three_way_logits().expand(200, VOCAB)
    states = [state(top_k=1 + (i % 2)) for i in range(200)]  # even rows greedy via top_k=1
    tokens = Sampler(VOCAB)(logits, states).token_ids
    assert set(tokens[0::2]) == {1}
    assert set(tokens[1::2]) == {1, 2}


# --- logprobs -----------------------------------------------------------------------------------


def test_logprobs_are_raw_and_hold_sampled_plus_top_n():
    logits = random_logits(3, seed=5)
    raw = logits.log_softmax(-1)
    # Row 0 is forced by logit_bias onto a token outside its raw top 2; row 1 asks for 0; row 2 does not ask.
    forced = int(logits[0].argmin())
    states = [greedy(logprobs=2, logit_bias={forced: 100.0}), greedy(logprobs=0), greedy()]
    out = Sampler(VOCAB)(logits, states)
    assert out.token_ids[0] == forced
    top2 = raw[0].topk(2).indices.tolist()
    assert set(out.logprobs[0]) == {forced, *top2}  # N + 1 entries
    for token_id, value in out.logprobs[0].items():
        assert math.isclose(value, raw[0, token_id].item(), rel_tol=1e-5, abs_tol=1e-6)  # before the bias
    assert out.logprobs[1] == pytest.approx({out.token_ids[1]: raw[1, out.token_ids[1]].item()})
    assert out.logprobs[2] is None


def test_logprobs_sampled_token_in_top_n_gives_n_entries():
    logits = random_logits(1, seed=6)
    out = Sampler(VOCAB)(logits, [greedy(logprobs=3)])
    assert len(out.logprobs[0]) == 3
    assert set(out.logprobs[0]) == set(logits.log_softmax(-1)[0].topk(3).indices.tolist())


def test_logprobs_for_sampled_rows():
    logits = random_logits(4, seed=8) / 3
    out = Sampler(VOCAB)(logits, [state(seed=i, logprobs=5) for i in range(4)])
    raw = logits.log_softmax(-1)
    for row, (token_id, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert token_id in entry and len(entry) in (5, 6)
        assert entry[token_id] == pytest.approx(raw[row, token_id].item(), abs=1e-6)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError):
        Sampler(VOCAB)(random_logits(2), [greedy()])
    with pytest.raises(ValueError):
        Sampler(VOCAB + 1)(random_logits(1), [greedy()])


def test_every_64_bit_seed_draws_its_own_tokens():
    """torch's CPU generator keeps only a seed's low 32 bits: seeds 2**32 apart (or at the ends of the 64-bit
    range) must still give different draws, and every step seed is one torch takes."""
    from pipeline.sampler import step_seed

    pairs = [(0, 2**32), (5, 5 + 2**32), (-1, -2**63), (0, 2**63 - 1), (-1, 2**64 - 1 - 2**63)]
    for a, b in pairs:
        for position in (0, 1, 1000):
            low_a, low_b = step_seed(a, position) & 0xFFFFFFFF, step_seed(b, position) & 0xFFFFFFFF
            assert low_a != low_b, (a, b, position)
    for seed in (-2**63, -1, 0, 2**63 - 1):
        assert 0 <= step_seed(seed, 7) < 2**63
        torch.Generator().manual_seed(step_seed(seed, 7))
