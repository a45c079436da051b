"""The multi-turn workload's sessions: seeded, a shared system prompt, fixed or exponential think times."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.serve_sessions import SessionSpec, build_sessions

SPEC = SessionSpec(num_sessions=40, num_turns=4, system_len=16, user_len=8, think_time_s=2.0, seed=3)


def test_sessions_share_the_system_prompt_and_repeat_with_their_seed():
    sessions = build_sessions(SPEC, 500, {0, 1})
    assert len({tuple(s.messages[0][:16]) for s in sessions}) == 1
    assert all(t not in (0, 1) for s in sessions for m in s.messages for t in m)
    again = build_sessions(SPEC, 500, {0, 1})
    assert [s.messages for s in again] == [s.messages for s in sessions]
    assert all(s.think_times_s == [2.0] * 3 for s in sessions)


def test_exponential_think_times_are_seeded_draws_with_the_mean():
    spec = replace(SPEC, think_time_distribution="exponential")
    sessions = build_sessions(spec, 500, set())
    pauses = [t for s in sessions for t in s.think_times_s]
    assert len(pauses) == 40 * 3 and len(set(pauses)) == len(pauses)
    assert 1.4 < sum(pauses) / len(pauses) < 2.6
    assert [s.think_times_s for s in build_sessions(spec, 500, set())] == [s.think_times_s for s in sessions]
    # the messages are those of the fixed-pause workload: only the pauses differ
    assert [s.messages for s in sessions] == [s.messages for s in build_sessions(SPEC, 500, set())]
    with pytest.raises(ValueError, match="think_time_distribution"):
        build_sessions(replace(SPEC, think_time_distribution="gamma"), 500, set())


def test_other_sessions_can_share_the_system_prompt_of_a_seed():
    """The benchmark's warm-up conversations: the measured workload's system prompt, other messages."""
    warm = build_sessions(replace(SPEC, num_sessions=2, seed=99, system_seed=SPEC.seed), 500, set())
    measured = build_sessions(SPEC, 500, set())
    assert warm[0].messages[0][:16] == measured[0].messages[0][:16]
    assert warm[0].messages[0][16:] != measured[0].messages[0][16:]


def test_later_turns_are_split_by_whether_the_worker_held_the_previous_turn():
    from bench.serve_sessions import PAGE_SIZE, TurnOutcome, summarize_turns

    def turn(session, index, prompt, cached, ttft_s):
        return TurnOutcome(session, index, prompt, cached, ttft_s, None if ttft_s is None else ttft_s + 1.0, 10)

    outcomes = [turn(0, 1, 100, 0, 0.2), turn(0, 2, 300, 100 - PAGE_SIZE, 0.1),  # held turn 1's prompt to a page
                turn(1, 1, 100, 0, 0.2), turn(1, 2, 300, 64, 0.9),  # another worker: only the system prompt
                turn(2, 1, 100, 0, 0.2), turn(2, 2, 300, 0, None)]  # failed: in neither
    outcomes[-1].error = "boom"
    report = summarize_turns(outcomes, 10.0)
    assert report["later_turns"]["count"] == 2
    assert report["later_turns_held_previous"]["count"] == 1
    assert report["later_turns_held_previous"]["median_ttft_ms"] == 100.0
    assert report["later_turns_missed_previous"]["median_ttft_ms"] == 900.0
