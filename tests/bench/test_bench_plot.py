"""bench.plot renders each bench/ report kind to a PNG and refuses JSON that is not one."""

from __future__ import annotations

import json

import pytest

from bench import plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

TRANSFER = {
    "benchmark": "transfer", "targets": {"zmq": 0.7, "shm": 0.5}, "config": {"total_mib": 64.0},
    "raw_zmq_1mib": {"gb_per_s": 3.0, "runs_s": [0.022, 0.023]}, "memcpy_libc": {"gb_per_s": 7.0, "runs_s": [0.0096]},
    "zmq": {"gb_per_s": 1.6, "runs_s": [0.04, 0.045]}, "shm": {"gb_per_s": 3.5, "runs_s": [0.019]},
    "raw_zmq_gb_per_s": 3.0, "memcpy_gb_per_s": 7.0, "ratios": {"zmq_vs_raw_zmq": 0.53, "shm_vs_memcpy": 0.5},
}
OFFLINE = {
    "benchmark": "offline_throughput", "ratio_output_tokens_per_s": 2.5, "workload": {"num_prompts": 4},
    "settings": {"threads": 1},
    "tandem": {"median_output_tokens_per_s": 500.0, "runs": [{"output_tokens_per_s": 500.0}]},
    "transformers": {"median_output_tokens_per_s": 200.0, "runs": [{"output_tokens_per_s": 200.0}]},
}
KERNELS = {"device": "H100", "dtype": "bfloat16", "peak_gbps": 3350.0,
           "results": [{"kernel": "paged_attention", "case": "decode", "triton_pct_peak": 71.0}]}


@pytest.mark.parametrize("report", [TRANSFER, OFFLINE, KERNELS], ids=["transfer", "offline", "kernels"])
def test_each_report_kind_renders_a_png(tmp_path, report):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert plot.main([str(path)]) == 0
    assert (tmp_path / "report.png").read_bytes().startswith(PNG_MAGIC)


def test_json_that_is_no_bench_report_is_refused(tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"hello": 1}))
    assert plot.main([str(path)]) == 2
    assert "not a bench/ report" in capsys.readouterr().err
    assert not (tmp_path / "other.png").exists()


def _serve_report(label: str, attainments: list[float]) -> dict:
    run_keys = {f"{s}_{n}_ms": 10.0 * (i + 1) for i, (s, n) in enumerate(
        (s, n) for s in ("median", "p99") for n in ("ttft", "tpot", "itl", "e2el"))}
    runs = [{"request_rate": rate, "slo_attainment": a, **run_keys,
             "groups": {"short": dict(run_keys), "long": dict(run_keys)}}
            for rate, a in zip((0.5, 1.0, float("inf")), attainments)]
    return {"benchmark": "serve", "label": label, "base_url": "http://x", "goodput_slos": {"tpot_ms": 100.0},
            "attainment_target": 0.9, "goodput_rate": 0.5, "runs": runs,
            "workload": {"dataset": "mixed", "num_prompts": 10, "long_fraction": 0.2, "long_input_len": 100,
                         "long_output_len": 2, "short_input_len": 10, "short_output_len": 20}}


@pytest.mark.parametrize("kind", ["serve", "serve_compare"])
def test_serving_reports_render_latency_and_slo_plots(tmp_path, kind):
    report = _serve_report("a", [1.0, 0.5, 0.2])
    if kind == "serve_compare":
        report = {"benchmark": "serve_compare", "systems": {"a": report, "b": _serve_report("b", [1.0, 1.0, 0.9])}}
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(report))
    assert plot.main([str(path)]) == 0
    for suffix in ("_latency.png", "_slo.png"):
        assert (tmp_path / f"serve{suffix}").read_bytes().startswith(PNG_MAGIC)
