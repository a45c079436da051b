"""``kernels/route_timing.py``: what the AMX routes (int8, bf16) decide from their timings, and how they time."""

from __future__ import annotations

from kernels.route_timing import best_of_alternating, measure_rows, native_max_rows, timings_text


def test_the_row_count_is_the_last_the_native_gemm_won_from_the_fewest_up():
    assert native_max_rows([(16, 1.0, 2.0), (32, 1.0, 2.0), (64, 3.0, 2.0)]) == 32
    assert native_max_rows([(16, 3.0, 2.0)]) == 0  # oneDNN from the fewest rows
    assert native_max_rows([(16, 1.0, 2.0), (256, 1.0, 2.0)]) is None  # the native GEMM for every batch
    assert native_max_rows([(1, 2.0, 2.0), (8, 3.0, 2.0)]) == 1  # a tie keeps the native GEMM


def test_rows_are_timed_from_the_fewest_up_and_stop_after_the_first_loss():
    asked = []

    def time_at(rows):
        asked.append(rows)
        return (1.0, 2.0) if rows < 32 else (3.0, 2.0)
    assert measure_rows(time_at, (64, 1, 32, 8, 128)) == [(1, 1.0, 2.0), (8, 1.0, 2.0), (32, 3.0, 2.0)]
    assert asked == [1, 8, 32]


def test_the_two_products_alternate_after_a_round_not_kept():
    calls = []
    first, second = best_of_alternating(lambda: calls.append("a"), lambda: calls.append("b"), repeats=2)
    assert calls == ["a", "b"] * 3 and 0 <= first < 1 and 0 <= second < 1


def test_the_timings_are_logged_in_milliseconds():
    assert timings_text([(1, 0.00274, 0.00402), (128, 0.02585, 0.02671)]) == "1: 2.74 / 4.02, 128: 25.85 / 26.71"
