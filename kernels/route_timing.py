"""Timing two ways of computing the same product on this machine, for the GEMM routes an AMX CPU measures at load
(``kernels/cpu_int8_route.py``, ``kernels/cpu_bf16_route.py``): a native GEMM against oneDNN's AMX path, by row
count, from the fewest rows up, and the most rows up to which the native one won every count."""

from __future__ import annotations

import time
from typing import Callable


def best_of_alternating(first: Callable[[], None], second: Callable[[], None], repeats: int) -> tuple[float, float]:
    """Best seconds of each over ``repeats`` rounds, the two alternating; a first round warms both up, not kept."""
    best = [float("inf"), float("inf")]
    for repeat in range(repeats + 1):
        for index, product in enumerate((first, second)):
            started = time.perf_counter()
            product()
            elapsed = time.perf_counter() - started
            if repeat > 0:
                best[index] = min(best[index], elapsed)
    return best[0], best[1]


def measure_rows(time_at: Callable[[int], tuple[float, float]], rows) -> list[tuple[int, float, float]]:
    """(rows, native s, oneDNN s) from the fewest rows up (``time_at(rows)``), stopping after the first count the
    native GEMM loses."""
    timings = []
    for num_rows in sorted(rows):
        timings.append((num_rows, *time_at(num_rows)))
        if timings[-1][1] > timings[-1][2]:
            break
    return timings


def native_max_rows(timings: list[tuple[int, float, float]]) -> int | None:
    """From (rows, native s, oneDNN s) in row order: the most rows up to which the native GEMM won every count (0: it
    lost from the fewest); None where it won every count timed (it then takes every batch)."""
    won = 0
    for rows, native_s, onednn_s in timings:
        if native_s > onednn_s:
            return won
        won = rows
    return None


def timings_text(timings: list[tuple[int, float, float]]) -> str:
    """``rows: native / oneDNN ms`` per count, for the routes' log lines."""
    return ", ".join(f"{rows}: {native_s * 1e3:.2f} / {onednn_s * 1e3:.2f}" for rows, native_s, onednn_s in timings)
