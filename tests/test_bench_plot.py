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
