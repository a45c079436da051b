"""The GPU kernel benchmark refuses cleanly where it cannot measure anything."""

from __future__ import annotations

import torch

from bench import kernel_bench


def test_exits_with_a_message_without_cuda(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "bench.json"
    assert kernel_bench.main(["--out", str(out)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not out.exists()


def test_defaults_to_the_h200_peak_and_bf16():
    args = kernel_bench.build_parser().parse_args([])
    assert args.peak_gbps == 4800 and args.dtype == "bf16"
