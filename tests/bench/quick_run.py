"""Run a benchmark's ``main`` in --quick mode in-process, as its test does, and check what every report owes."""

from __future__ import annotations

import json

import torch


def quick_report(module, out, benchmark: str) -> dict:
    """``module.main(["--quick", "--out", out])``: the JSON on disk is the report returned, the caller's
    torch threads are given back, and the report names its benchmark."""
    threads = torch.get_num_threads()
    report = module.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert torch.get_num_threads() == threads
    assert report["benchmark"] == benchmark
    return report
