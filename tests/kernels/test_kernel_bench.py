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


def test_peak_bandwidth_defaults_to_h200():
    assert "4800" in kernel_bench.__doc__ and "3350" in kernel_bench.__doc__
