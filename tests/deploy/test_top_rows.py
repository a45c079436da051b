"""deploy.top_rows: two scrapes of a router's /metrics into ``tandem top``'s totals and worker rows."""

from __future__ import annotations

import pytest

from deploy.top_rows import Scrape, build_view

READY = {"ready": True, "reason": "1 DecodeOnly and 1 PrefillOnly worker(s) alive",
         "workers": [{"worker_id": "prefill-0", "pid": 101, "rank_pids": [201]},
                     {"worker_id": "decode-0", "pid": 102, "rank_pids": []}]}


def metrics_text(*, ok: float, errors: float, ttft: tuple[float, float], decode_tpot: tuple[float, float],
                 decode_bytes: float, decode_running: int, prefill_busy: float = 0.0, decode_up: int = 1,
                 restarts: int = 0, decode_queued: int = 0) -> str:
    """A router's /metrics in the exposition format, with the samples ``tandem top`` reads."""
    p, d = 'role="PrefillOnly",worker="prefill-0"', 'role="DecodeOnly",worker="decode-0"'
    return f"""\
tandem_requests_total{{outcome="ok"}} {ok}
tandem_requests_total{{outcome="error"}} {errors}
tandem_requests_total{{outcome="rejected"}} 5
tandem_requests_in_flight 3
tandem_router_admission_queue_depth 2
tandem_time_to_first_token_seconds_sum {ttft[0]}
tandem_time_to_first_token_seconds_count {ttft[1]}
tandem_time_per_output_token_seconds_sum{{worker="decode-0"}} {decode_tpot[0]}
tandem_time_per_output_token_seconds_count{{worker="decode-0"}} {decode_tpot[1]}
tandem_worker_time_to_first_token_seconds_sum{{worker="decode-0"}} {ttft[0]}
tandem_worker_time_to_first_token_seconds_count{{worker="decode-0"}} {ttft[1]}
tandem_worker_up{{{d}}} {decode_up}
tandem_worker_up{{{p}}} 1
tandem_worker_restarts_total{{{d}}} {restarts}
tandem_worker_restarts_total{{{p}}} 0
tandem_worker_running_requests{{{d}}} {decode_running}
tandem_worker_running_requests{{{p}}} 0
tandem_worker_queue_depth{{{d}}} {decode_queued}
tandem_worker_queue_depth{{{p}}} 0
tandem_kv_blocks_used{{{d}}} 128
tandem_kv_blocks_capacity{{{d}}} 512
tandem_kv_blocks_used{{{p}}} 0
tandem_kv_blocks_capacity{{{p}}} 512
tandem_kv_transfer_bytes_total{{{d}}} {decode_bytes}
tandem_worker_busy_in_step_seconds{{{p}}} {prefill_busy}
tandem_worker_draining{{{p}}} 0
"""


def test_rates_and_now_latencies_are_differences_between_two_scrapes():
    before = Scrape.parse(10.0, metrics_text(ok=10, errors=1, ttft=(1.0, 10), decode_tpot=(0.5, 10),
                                             decode_bytes=1e6, decode_running=0), READY)
    after = Scrape.parse(12.0, metrics_text(ok=18, errors=3, ttft=(1.8, 14), decode_tpot=(0.9, 18),
                                            decode_bytes=5e6, decode_running=4, prefill_busy=2.5,
                                            decode_queued=1), READY)
    view = build_view(before, after)
    t = view.totals
    assert t.requests_per_s == pytest.approx((8 + 2) / 2)  # every outcome counts as a request; 2 s apart
    assert t.errors_per_s == pytest.approx(1.0) and t.num_errors == 3  # "rejected" (4xx) is not a server error
    assert (t.num_in_flight, t.num_queued) == (3, 2)
    assert t.ttft_s == pytest.approx(0.8 / 4) and t.tpot_s == pytest.approx(0.4 / 8)
    assert view.is_ready and view.ready_reason.startswith("1 DecodeOnly") and view.interval_s == pytest.approx(2.0)
    prefill, decode = view.rows  # prefill workers first: the order a request meets them
    assert (prefill.worker, prefill.role, prefill.pid, prefill.state) == ("prefill-0", "PrefillOnly", 101, "busy 2.5s")
    assert (decode.worker, decode.role, decode.pid, decode.state) == ("decode-0", "DecodeOnly", 102, "serving")
    assert (prefill.num_ranks, decode.num_ranks) == (2, 1)  # a tensor-parallel worker's processes
    assert (decode.num_running, decode.num_queued, decode.kv_used_fraction) == (4, 1, 0.25)
    assert decode.ttft_s == pytest.approx(0.2) and decode.tpot_s == pytest.approx(0.05)
    assert decode.transfer_bytes_per_s == pytest.approx(2e6)
    assert prefill.ttft_s is None and prefill.tpot_s is None  # nothing observed there in the interval


def test_a_quiet_interval_has_no_latency_and_a_restarted_workers_counters_start_over():
    before = Scrape.parse(0.0, metrics_text(ok=10, errors=0, ttft=(1.0, 10), decode_tpot=(0.5, 10),
                                            decode_bytes=9e6, decode_running=0))
    after = Scrape.parse(1.0, metrics_text(ok=10, errors=0, ttft=(1.0, 10), decode_tpot=(0.5, 10),
                                           decode_bytes=1e6, decode_running=0, restarts=1))
    view = build_view(before, after)
    assert view.totals.requests_per_s == 0 and view.totals.ttft_s is None and view.totals.tpot_s is None
    assert view.is_ready is None  # /ready not read
    decode = view.rows[1]
    assert decode.state == "idle" and decode.num_restarts == 1
    assert decode.transfer_bytes_per_s == pytest.approx(1e6)  # the new process's counter, from 0


def test_a_dead_worker_is_a_row_that_says_so():
    text = metrics_text(ok=1, errors=0, ttft=(0.1, 1), decode_tpot=(0.1, 1), decode_bytes=0, decode_running=0,
                        decode_up=0)
    view = build_view(Scrape.parse(0.0, text), Scrape.parse(1.0, text))
    assert [(row.worker, row.state) for row in view.rows] == [("prefill-0", "idle"), ("decode-0", "dead")]
