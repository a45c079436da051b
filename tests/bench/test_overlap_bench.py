"""The overlap benchmark end to end in --quick mode: its report, the token check it makes, its plot; and
its profiler, which must survive a renamed method and leave the engine as it found it."""

from __future__ import annotations

from bench import overlap_bench, plot
from tests.bench.quick_run import quick_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_quick_run_reports_both_modes_identical_tokens_and_plots(tmp_path):
    out = tmp_path / "overlap.json"
    report = quick_report(overlap_bench, out, "overlap")
    assert report["outputs_identical"] is True  # the overlap pipeline changed no token
    assert report["model"]["hidden_size"] == 64 and report["model"]["num_hidden_layers"] == 2
    assert {"threads", "date", "repeats"} <= report["settings"].keys()
    assert {"cpu_model", "torch_version"} <= report["machine"].keys()
    assert [r["batch_size"] for r in report["results"]] == [1, 4]
    for result in report["results"]:
        assert result["outputs_identical"] and result["num_runs_identical"] == result["num_runs"] == 4
        for mode in ("off", "on"):
            (run,) = result[mode]["runs"]
            assert run["output_tokens"] == result["batch_size"] * 16
            assert result[mode]["median_output_tokens_per_s"] == run["output_tokens_per_s"] > 0
        assert result["ratio_on_off"] > 0 and len(result["ratio_per_repeat"]) == 1
        profile = result["profile_overlap_off"]
        assert isinstance(profile["missing"], list)  # a renamed host method is listed there, not fatal
        assert profile["num_steps"] >= 16  # one step per output token at least
        assert profile["phases"]["forward"]["calls"] == profile["num_steps"]
        assert 0 < profile["host_share"] < 1
        assert abs(sum(p["share_of_step"] for p in profile["phases"].values()) - 1) < 1e-6

    assert plot.main([str(out)]) == 0
    assert (tmp_path / "overlap.png").read_bytes().startswith(PNG_MAGIC)


class _Part:
    def work(self, x):
        return x + 1


class _Engine:
    def __init__(self):
        self.part = _Part()

    def step(self):
        return self.part.work(1)


def test_profiler_lists_a_missing_method_and_restores_what_it_wrapped():
    engine = _Engine()
    paths = {"step": "engine.step", "work": "engine.part.work", "gone": "engine.part.renamed",
             "nowhere": "engine.missing.method"}
    with overlap_bench.timed_methods(engine, paths) as (seconds, calls, missing):
        assert engine.step() == 2
    assert missing == ["engine.part.renamed", "engine.missing.method"]
    assert calls == {"step": 1, "work": 1, "gone": 0, "nowhere": 0} and seconds["step"] >= seconds["work"] > 0
    assert "step" not in vars(engine) and "work" not in vars(engine.part)  # the classes' methods again
