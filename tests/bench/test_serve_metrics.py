"""Serving metrics from request outcomes: vLLM's definitions and keys, goodput and SLO attainment."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from bench.serve_client import RequestOutcome, sse_lines
from bench.serve_metrics import goodput_rate, meets_slos, parse_goodput, summarize, summarize_by_group
from bench.serve_workload import BenchRequest


def outcome(group="short", ttft=0.1, e2el=1.0, tokens=10, ok=True, status=None) -> RequestOutcome:
    request = BenchRequest("p", 8, tokens, group, 0.0)
    if not ok:
        return RequestOutcome(request, error="boom", status_code=status)
    return RequestOutcome(request, is_success=True, ttft_s=ttft, e2el_s=e2el, output_tokens=tokens,
                          itl_s=[(e2el - ttft) / max(tokens - 1, 1)] * (tokens - 1))


def test_tpot_excludes_the_first_token():
    assert outcome(ttft=0.1, e2el=1.0, tokens=10).tpot_s == pytest.approx(0.1)
    assert outcome(tokens=1, e2el=0.1).tpot_s is None


def test_summary_uses_vllm_keys_and_counts_failures():
    outcomes = [outcome(), outcome(ttft=0.3, e2el=2.1), outcome(ok=False, status=429)]
    summary = summarize(outcomes, duration_s=4.0, slos={})
    assert summary["completed"] == 2 and summary["failed"] == 1 and summary["rejected_429"] == 1
    assert summary["total_output_tokens"] == 20 and summary["total_input_tokens"] == 16
    assert summary["request_throughput"] == pytest.approx(0.5)
    assert summary["output_throughput"] == pytest.approx(5.0)
    assert summary["median_ttft_ms"] == pytest.approx(200.0)
    assert summary["mean_tpot_ms"] == pytest.approx(150.0)
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert {f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms", f"p90_{name}_ms", f"p99_{name}_ms"} <= set(summary)
    assert "request_goodput" not in summary


def test_goodput_counts_requests_within_every_slo_and_failures_never_attain():
    slos = parse_goodput(["ttft:200", "tpot:150"])
    assert slos == {"ttft_ms": 200.0, "tpot_ms": 150.0}
    fast, slow_first, slow_tokens = outcome(ttft=0.1, e2el=1.0), outcome(ttft=0.3, e2el=1.0), outcome(ttft=0.1, e2el=3.0)
    assert meets_slos(fast, slos) and not meets_slos(slow_first, slos) and not meets_slos(slow_tokens, slos)
    assert meets_slos(outcome(tokens=1, e2el=0.1), slos)  # one token: no TPOT to miss
    summary = summarize([fast, slow_first, slow_tokens, outcome(ok=False)], duration_s=2.0, slos=slos)
    assert summary["request_goodput"] == pytest.approx(0.5)
    assert summary["slo_attainment"] == pytest.approx(0.25)


@pytest.mark.parametrize("bad", ["ttft", "ttft:", "speed:10", "tpot:fast", "e2el:-1"])
def test_bad_goodput_specs_are_refused(bad):
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput([bad])


def test_groups_and_goodput_rate():
    outcomes = [outcome("short"), outcome("long", ttft=2.0, e2el=2.0, tokens=2)]
    groups = summarize_by_group(outcomes, 1.0, {})
    assert set(groups) == {"long", "short"} and groups["long"]["median_ttft_ms"] == pytest.approx(2000.0)
    assert summarize_by_group([outcome("random")], 1.0, {}) == {}
    runs = [{"request_rate": 1.0, "slo_attainment": 0.95}, {"request_rate": 2.0, "slo_attainment": 0.91},
            {"request_rate": 3.0, "slo_attainment": 0.5}, {"request_rate": float("inf"), "slo_attainment": 1.0}]
    assert goodput_rate(runs, 0.9) == 2.0
    assert goodput_rate(runs, 0.99) is None


def test_sse_lines_split_on_newlines_only():
    body = 'data: {"text": "a\u2028b\x85c"}\r\n\ndata: [DONE]\n'.encode()

    async def lines():
        response = httpx.Response(200, stream=httpx.ByteStream(body))
        return [line async for line in sse_lines(response)]

    assert asyncio.run(lines()) == ['data: {"text": "a\u2028b\x85c"}'.encode(), b"", b"data: [DONE]"]
