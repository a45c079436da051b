"""The structured-output benchmark end to end in --quick mode: its report, the mask check it makes (and
that the check can fail), its plot, also with a backend that is not there and llguidance's own apply."""

from __future__ import annotations

import copy
import json

import torch

from bench import plot, structured_output_bench
from tests.bench.quick_run import quick_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PARTS = ("fill", "accept", "apply")


def test_quick_run_reports_every_part_checks_every_mask_and_plots(tmp_path):
    out = tmp_path / "so.json"
    report = quick_report(structured_output_bench, out, "structured_output")
    settings = report["settings"]
    assert {"vocab_size", "steps", "threads", "date", "loadavg_1min_start", "loadavg_1min_end"} <= settings.keys()
    assert settings["steps"] == 5 and settings["backends"] == ["llguidance"]
    assert 1900 <= report["tokenizer"]["vocab_size"] == settings["vocab_size"] <= 2000  # the BPE reached its size
    assert {"cpu_model", "torch_version"} <= report["machine"].keys()
    compile_ms = report["backends"]["llguidance"]["compile"]
    assert compile_ms["first_matcher_ms"] > 0 and compile_ms["cached_matcher_ms"] > 0
    assert "skipped" in report["llguidance_apply"]  # --quick never waits for torch.compile
    assert min(report["document_tokens"]) > 20  # real documents, EOS included

    assert [(r["backend"], r["batch_size"]) for r in report["results"]] == [("llguidance", 1), ("llguidance", 4)]
    for result in report["results"]:
        for part in PARTS:
            assert len(result[part]["samples_us"]) == 5
            assert 0 < result[part]["median_us"] <= result[part]["p90_us"]
        # 1 warm-up + 5 timed steps, one mask per row each: every one non-empty and allowing the document
        assert result["masks_checked"] == 6 * result["batch_size"]
        assert result["masks_empty"] == result["masks_not_allowing_document"] == 0
        assert result["accepts_rejected"] == result["prefix_tokens_rejected"] == 0
        assert result["masks_allow_document"] is True
        assert result["allowed_tokens_median"] >= 1
    assert report["results"][1]["distinct_masks_per_step_median"] > 1  # rows sit at different points
    assert report["masks_allow_document"] is True

    assert plot.main([str(out)]) == 0
    assert (tmp_path / "so.png").read_bytes().startswith(PNG_MAGIC)


def test_mask_check_catches_a_mask_that_forbids_the_next_token():
    bitmask = torch.zeros(3, 2, dtype=torch.int32)  # vocab 64
    bitmask[0, 0] = 1 << 5  # row 0 allows token 5 only
    bitmask[1, 1] = -(2**31)  # row 1 allows token 63 only (the sign bit)
    check = structured_output_bench.check_masks(bitmask, torch.tensor([5, 62, 0]))
    assert check["is_allowed"].tolist() == [True, False, False]
    assert check["allowed_counts"].tolist() == [1, 1, 0]  # row 2 is empty
    assert check["distinct"] == 3


def test_plot_shows_an_unavailable_backend_and_llguidance_apply(tmp_path):
    stats = {"median_us": 10.0, "p90_us": 12.0}
    result = {"backend": "llguidance", "batch_size": 64, "fill_share_of_reference_step": 0.25,
              **{part: dict(stats) for part in (*PARTS, "apply_llguidance")}}
    report = {"benchmark": "structured_output", "settings": {"vocab_size": 32000, "threads": 1},
              "backends": {"llguidance": {"available": True}, "xgrammar": {"available": False, "reason": "unknown"}},
              "reference": {"batch_size": 64, "step_us": 3000.0}, "masks_allow_document": True,
              "results": [result, {**copy.deepcopy(result), "batch_size": 1,
                                   "fill": {"median_us": 0.5, "p90_us": 1.0}}]}
    path = tmp_path / "so.json"
    path.write_text(json.dumps(report))
    assert plot.main([str(path)]) == 0
    assert (tmp_path / "so.png").read_bytes().startswith(PNG_MAGIC)
