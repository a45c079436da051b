"""The speculative decoding benchmark end to end in --quick mode: its report (throughput off and on,
acceptance, the verify cost model), the exactness check it makes, and its plot."""

from __future__ import annotations

from bench import plot, speculative_bench
from tests.bench.quick_run import quick_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_quick_run_reports_modes_acceptance_costs_identical_tokens_and_plots(tmp_path):
    out = tmp_path / "spec.json"
    report = quick_report(speculative_bench, out, "speculative")
    assert report["outputs_identical"] is True  # greedy speculative decoding changed no token
    target, draft = report["model"]["target"], report["model"]["draft"]
    assert target["hidden_size"] == 64 and target["num_hidden_layers"] == 2 and target["scaled_tensors"] == 2
    assert draft == {"kind": "truncated_copy", "num_hidden_layers": 1}
    settings = report["settings"]
    assert settings["num_speculative_tokens"] == [2] and settings["repeats"] == 1
    assert {"threads", "date", "loadavg_1min_start", "loadavg_1min_end"} <= settings.keys()
    assert {"cpu_model", "torch_version"} <= report["machine"].keys()
    assert [r["batch_size"] for r in report["results"]] == [1, 2]
    max_tokens = report["workload"]["max_tokens"]
    for result in report["results"]:
        batch_size = result["batch_size"]
        # every run, warm-ups included, gave the speculation-off tokens
        assert result["outputs_identical"] and result["num_runs_identical"] == result["num_runs"] == 4
        assert 0 < result["distinct_token_share"] <= 1
        for mode in ("off", "k2"):
            (run,) = result[mode]["runs"]
            assert run["output_tokens"] == batch_size * max_tokens and run["outputs_identical"]
            assert result[mode]["median_output_tokens_per_s"] == run["output_tokens_per_s"] > 0
            assert run["num_steps"] >= 2 and run["step_ms"] > 0
        assert "propose_ms_per_step" not in result["off"]["runs"][0]
        assert result["k2"]["runs"][0]["propose_ms_per_step"] > 0
        assert result["k2"]["runs"][0]["verify_forward_ms_per_step"] > 0
        # at most one step per token plus the prefill, at least one per K + 1 tokens
        assert max_tokens / 3 <= result["k2"]["runs"][0]["num_steps"] <= result["off"]["runs"][0]["num_steps"]

        (spec,) = result["speculative"]
        assert spec["num_speculative_tokens"] == 2 and len(spec["ratio_per_repeat"]) == 1
        assert spec["ratio_on_off"] == spec["measured_speedup"] > 0
        acc = spec["acceptance"]
        # every verify of one request: 1..K drafts (fewer at the end), 0..k accepted
        assert acc["num_drafts"] > 0 and acc["num_drafts"] <= acc["num_draft_tokens"] <= 2 * acc["num_drafts"]
        assert 0 <= acc["num_accepted_tokens"] <= acc["num_draft_tokens"]
        assert 0 <= acc["acceptance_rate"] <= 1 and 1 <= acc["mean_acceptance_length"] <= 3
        assert acc["acceptance_rate"] == acc["num_accepted_tokens"] / acc["num_draft_tokens"]
        assert len(acc["accepted_per_position"]) == len(acc["acceptance_per_position"]) == 2
        assert sum(acc["accepted_per_position"]) == acc["num_accepted_tokens"]
        assert all(0 <= p <= 1 for p in acc["acceptance_per_position"])
        first, second = acc["accepted_per_position"]
        assert second <= first  # position 2 is accepted only after position 1
        # the verifies of the timed repeat emitted its tokens, but for each request's prefill token and the
        # plain decode steps of its last tokens (no room left for a draft)
        assert batch_size <= acc["num_accepted_tokens"] + acc["num_drafts"] <= batch_size * (max_tokens - 1)

        costs = result["costs"]
        assert set(costs["median_ms"]) == {"target_1", "target_3", "draft_1"}
        assert all(ms > 0 for ms in costs["median_ms"].values()) and costs["reps"] == 3
        assert costs["draft_step_ratio"] > 0 and costs["verify_cost_ratio"]["2"] > 0
        assert spec["verify_cost_ratio"] == costs["verify_cost_ratio"]["2"]
        assert spec["predicted_step_cost"] == 2 * costs["draft_step_ratio"] + spec["verify_cost_ratio"]
        assert spec["predicted_speedup"] == acc["mean_acceptance_length"] / spec["predicted_step_cost"]

    assert plot.main([str(out)]) == 0
    assert (tmp_path / "spec.png").read_bytes().startswith(PNG_MAGIC)
