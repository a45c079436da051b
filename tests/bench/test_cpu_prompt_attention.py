"""``bench/cpu_prompt_attention.py``: both prompt-attention paths timed and compared on this CPU, the crossover
it reports (``crossover`` itself: tests/cpu_kernels/test_cpu_prompt_route.py), and the route forced for the timing
restored afterwards."""

from __future__ import annotations

import json

import pytest

from bench.cpu_prompt_attention import main
from kernels import cpu_native, cpu_paged_attention


def test_a_small_run_writes_its_report_and_plot(tmp_path, capsys):
    if cpu_native.ops is None:
        pytest.skip("kernels._cpu_ops is not built")
    chosen = cpu_paged_attention.FLASH_MIN_QUERY_ROWS
    out = tmp_path / "prompt_attention.json"
    assert main(["--rows", "16", "48", "--prefixes", "0", "40", "--repeats", "2", "--out", str(out)]) == 0
    assert cpu_paged_attention.FLASH_MIN_QUERY_ROWS == chosen
    report = json.loads(out.read_text())
    assert report["benchmark"] == "prompt_attention" and report["threads"] == 1
    assert [(c["rows"], c["prefix"]) for c in report["cases"]] == [(16, 0), (48, 0), (16, 40), (48, 40)]
    for c in report["cases"]:
        assert len(c["native_s"]) == len(c["torch_s"]) == 2
        assert c["max_abs_diff"] < 0.05  # the same attention in bf16 either way
    assert report["route_chosen"] == cpu_paged_attention.describe_prompt_route()
    assert out.with_suffix(".png").stat().st_size > 0
    assert "TANDEM_CPU_FLASH_MIN_QUERY_ROWS=" in capsys.readouterr().out
