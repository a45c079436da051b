"""Serving metrics from request outcomes, under vLLM ``bench serve``'s key names.

``request_goodput`` (vLLM): completed requests per second that met every SLO of ``--goodput``.
``slo_attainment`` (DistServe): the share of *all* sent requests that completed within every SLO — a
failed request never attains. ``goodput_rate`` (DistServe's goodput, over a rate sweep): the highest
request rate whose SLO attainment is at least ``attainment_target`` (90 %).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

import numpy as np

from bench.serve_client import RequestOutcome

PERCENTILES = (90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")
SLO_KEYS = {"ttft", "tpot", "e2el"}


def parse_goodput(items: Iterable[str] | None) -> dict[str, float]:
    """``["ttft:2000", "tpot:100"]`` -> ``{"ttft_ms": 2000.0, "tpot_ms": 100.0}``."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, _, value = item.partition(":")
        if name not in SLO_KEYS or not value:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {sorted(SLO_KEYS)} (got {item!r})")
        try:
            slos[f"{name}_ms"] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[f"{name}_ms"] <= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be > 0 ms")
    return slos


def meets_slos(outcome: RequestOutcome, slos: dict[str, float]) -> bool:
    if not outcome.is_success:
        return False
    values_s = {"ttft_ms": outcome.ttft_s, "tpot_ms": outcome.tpot_s, "e2el_ms": outcome.e2el_s}
    for key, limit_ms in slos.items():
        value_s = values_s[key]
        if value_s is None:  # only TPOT can be missing (a one-token output): it cannot miss its SLO
            continue
        if value_s * 1000 > limit_ms:
            return False
    return True


def latency_stats(name: str, values_s: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1000 if values_s else np.zeros(1)
    stats = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
             f"std_{name}_ms": float(ms.std())}
    for p in PERCENTILES:
        stats[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return stats


def summarize(outcomes: list[RequestOutcome], duration_s: float, slos: dict[str, float]) -> dict:
    """One run's metrics (vLLM's keys), for the given outcomes."""
    done = [o for o in outcomes if o.is_success]
    input_tokens = sum(o.prompt_tokens if o.prompt_tokens is not None else o.request.prompt_len for o in done)
    output_tokens = sum(o.output_tokens for o in done)
    summary: dict = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "rejected_429": sum(o.status_code == 429 for o in outcomes),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s if duration_s else 0.0,
        "output_throughput": output_tokens / duration_s if duration_s else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s if duration_s else 0.0,
    }
    series = {
        "ttft": [o.ttft_s for o in done],
        "tpot": [o.tpot_s for o in done if o.tpot_s is not None],
        "itl": [gap for o in done for gap in o.itl_s],
        "e2el": [o.e2el_s for o in done],
    }
    for name in LATENCIES:
        summary.update(latency_stats(name, series[name]))
    if slos:
        meeting = sum(meets_slos(o, slos) for o in outcomes)
        summary["request_goodput"] = meeting / duration_s if duration_s else 0.0
        summary["slo_attainment"] = meeting / len(outcomes) if outcomes else 0.0
    return summary


def summarize_by_group(outcomes: list[RequestOutcome], duration_s: float, slos: dict[str, float]) -> dict:
    groups = sorted({o.request.group for o in outcomes})
    if len(groups) < 2:
        return {}
    return {g: summarize([o for o in outcomes if o.request.group == g], duration_s, slos) for g in groups}


def goodput_rate(runs: list[dict], attainment_target: float) -> float | None:
    """DistServe's goodput: the highest finite rate of a sweep whose SLO attainment reaches the target
    (None when no run does or no SLO was given)."""
    passing = [r["request_rate"] for r in runs
               if r.get("slo_attainment", 0.0) >= attainment_target and r["request_rate"] != float("inf")]
    return max(passing) if passing else None


def errors_seen(outcomes: list[RequestOutcome], limit: int = 5) -> list[str]:
    """The most common failure messages (first ``limit``), for the report."""
    counts = Counter(o.error for o in outcomes if o.error)
    return [f"{n} x {error}" for error, n in counts.most_common(limit)]
