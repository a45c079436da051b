"""This machine's memory bandwidth, STREAM-style, with torch on the benchmark's threads::

    python -m bench.memory_bandwidth --threads 2

Arrays of ``size_mib`` each (far past the last-level cache), each kernel timed ``repeats`` times after a
warm-up, the median reported in GB/s (1e9 bytes/s) counted as STREAM counts (bytes the kernel names, no
write-allocate traffic):

- ``copy``  ``a[:] = b``           2 arrays' bytes;
- ``triad`` ``a[:] = b + s * c``   3 arrays' bytes;
- ``read``  ``b.sum()``            1 array's bytes: what a decode step does to its weights.

The batch-1 decode bound of ``bench/peer_compare.py`` is weight bytes per token / ``copy`` (the issue's
measure); ``read`` is reported beside it because it is the faster one here, so the fraction against it is
the stricter.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def timed(fn, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def measure(threads: int, size_mib: int = 512, repeats: int = 9) -> dict:
    """Median GB/s of copy, triad and read on ``threads`` torch threads, every repeat kept."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = size_mib * (1 << 20) // 4
        a, b, c = (torch.full((n,), v, dtype=torch.float32) for v in (0.0, 1.0, 2.0))
        sink = torch.empty((), dtype=torch.float32)
        kernels = {
            "copy": (lambda: a.copy_(b), 2),
            "triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 3),
            "read": (lambda: torch.sum(b, dim=0, out=sink), 1),
        }
        report = {"threads": threads, "array_mib": size_mib, "repeats": repeats}
        for name, (fn, num_arrays) in kernels.items():
            rates = [num_arrays * a.nbytes / t / 1e9 for t in timed(fn, repeats)]
            report[name] = {"median_gb_s": statistics.median(rates), "gb_s": rates}
        return report
    finally:
        torch.set_num_threads(previous)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.threads, args.size_mib, args.repeats), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
