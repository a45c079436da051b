"""The serving benchmark's workload: seeded arrivals in vLLM's conventions and prompts of exact length."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from transformers import AutoTokenizer

from bench.serve_workload import (PromptBuilder, WorkloadSpec, arrival_offsets, build_workload,
                                  scheduled)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))


def test_arrivals_are_seeded_and_average_one_over_the_rate():
    offsets = arrival_offsets(4000, rate=5.0, burstiness=1.0, seed=3)
    assert offsets == arrival_offsets(4000, rate=5.0, burstiness=1.0, seed=3)
    assert offsets != arrival_offsets(4000, rate=5.0, burstiness=1.0, seed=4)
    assert offsets[0] == 0.0 and all(b >= a for a, b in zip(offsets, offsets[1:]))
    assert np.mean(np.diff(offsets)) == pytest.approx(0.2, rel=0.05)


def test_a_sweep_replays_one_pattern_faster_and_burstiness_shapes_the_gaps():
    slow, fast = arrival_offsets(50, 1.0, seed=1), arrival_offsets(50, 4.0, seed=1)
    assert fast == pytest.approx([t / 4 for t in slow])
    bursty = np.diff(arrival_offsets(4000, 1.0, burstiness=0.25, seed=0))
    regular = np.diff(arrival_offsets(4000, 1.0, burstiness=8.0, seed=0))
    assert np.std(bursty) > 1.5 > 0.5 > np.std(regular)  # gamma: std = mean / sqrt(shape)


def test_infinite_rate_sends_everything_at_once_and_bad_rates_are_refused():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError, match="rate"):
        arrival_offsets(5, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(5, 1.0, burstiness=0.0)


@pytest.mark.parametrize("is_chat", [False, True], ids=["completion", "chat"])
def test_prompts_encode_to_exactly_the_length_asked_for(tokenizer, is_chat):
    builder = PromptBuilder(tokenizer, is_chat=is_chat)
    rng = random.Random(0)
    for length in (12, 33, 64, 200):
        text, measured = builder.build(length, rng)
        assert measured == length
        assert builder.encoded_len(text) == length


def test_mixed_workload_has_its_fraction_of_long_requests_and_fresh_prompts_per_salt(tokenizer):
    spec = WorkloadSpec(dataset="mixed", num_prompts=20, long_fraction=0.25, long_input_len=120, long_output_len=2,
                        short_input_len=16, short_output_len=9, seed=5)
    builder = PromptBuilder(tokenizer, is_chat=True)
    first = build_workload(spec, builder, salt=0)
    assert [r.group for r in first].count("long") == 5
    assert all((r.prompt_len, r.output_len) == ((120, 2) if r.group == "long" else (16, 9)) for r in first)
    again, other = build_workload(spec, builder, salt=0), build_workload(spec, builder, salt=1)
    assert [r.prompt for r in again] == [r.prompt for r in first]
    assert [r.group for r in other] == [r.group for r in first]  # same shapes, other text
    assert not {r.prompt for r in other} & {r.prompt for r in first}
    timed = scheduled(first, 2.0, 1.0, seed=5)
    assert [r.arrival_s for r in timed] == pytest.approx(arrival_offsets(20, 2.0, 1.0, seed=5))


def test_an_unknown_dataset_is_refused():
    with pytest.raises(ValueError, match="dataset"):
        WorkloadSpec(dataset="sharegpt").shapes()
