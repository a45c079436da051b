"""``tandem bench serve`` against a live 1P1D cluster (real processes, real HTTP): its report has
vLLM's keys, its counts agree with the router's ``/metrics``, the leak check passes and the plots are
written. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.conftest import start_cluster

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NUM_PROMPTS = 12
LATENCY_KEYS = {f"{stat}_{name}_ms" for stat in ("mean", "median", "std", "p90", "p99")
                for name in ("ttft", "tpot", "itl", "e2el")}
RUN_KEYS = {"request_rate", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "total_token_throughput", "request_goodput",
            "slo_attainment", "groups", "tandem", "errors"} | LATENCY_KEYS


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, tmp_path_factory):
    cluster = start_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp("bench-logs"))
    yield cluster
    cluster.stop()


def bench(cluster, out: Path, *args: str, tokenizer: bool = True) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "deploy.cli", "bench", "serve", "--base-url", cluster.url,
               "--no-progress", "--out", str(out), *args]
    if tokenizer:
        command += ["--tokenizer", cluster.config["model"]["model_path"]]
    return subprocess.run(command, capture_output=True, text=True, timeout=240)


def test_report_keys_and_counts_agree_with_the_server(cluster, tmp_path):
    out = tmp_path / "serve.json"
    done = bench(cluster, out, "--dataset", "mixed", "--num-prompts", str(NUM_PROMPTS), "--mixed-long-fraction", "0.25",
                 "--mixed-long-input-len", "96", "--mixed-long-output-len", "2", "--mixed-short-input-len", "12",
                 "--mixed-short-output-len", "6", "--request-rate", "20,inf", "--ignore-eos",
                 "--goodput", "ttft:60000", "tpot:60000")
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["benchmark"] == "serve" and report["goodput_rate"] == 20.0
    assert [run["request_rate"] for run in report["runs"]] == [20.0, float("inf")]
    for run in report["runs"]:
        assert RUN_KEYS <= set(run), RUN_KEYS - set(run)
        assert run["completed"] == NUM_PROMPTS and run["failed"] == 0 and run["errors"] == []
        assert run["total_output_tokens"] == 3 * 2 + 9 * 6  # ignore_eos: exactly max_tokens each
        assert run["total_input_tokens"] == 3 * 96 + 9 * 12  # the server's own prompt counts
        assert set(run["groups"]) == {"long", "short"} and run["groups"]["long"]["completed"] == 3
        server = run["tandem"]
        assert server["requests_by_outcome"]["ok"] == run["completed"]
        assert sum(server["requests_by_outcome"].values()) == NUM_PROMPTS
        assert server["leak_check"] == "pass" and server["kv_blocks_used_after"] == 0
        assert server["kv_bytes_received_per_request"] > 0  # max_local_prefill_length 0: every prompt moved
    for suffix in ("_latency.png", "_slo.png"):
        assert (tmp_path / f"serve{suffix}").read_bytes().startswith(PNG_MAGIC)


def test_chat_endpoint_with_the_servers_first_model_and_its_tokenizer(cluster, tmp_path):
    out = tmp_path / "chat.json"
    done = bench(cluster, out, "--endpoint", "/v1/chat/completions", "--num-prompts", "4", "--random-input-len", "20",
                 "--random-output-len", "5", "--ignore-eos", "--num-warmups", "0", tokenizer=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert Path(report["tokenizer"]) == Path(cluster.config["model"]["model_path"]).resolve()  # /v1/models "root"
    run = report["runs"][0]
    assert report["model"] == Path(cluster.config["model"]["model_path"]).name
    assert run["completed"] == 4 and run["total_input_tokens"] == 4 * 20 and run["total_output_tokens"] == 4 * 5
    assert "goodput_rate" not in report and "request_goodput" not in run


def test_a_server_that_is_not_there_is_one_clear_error(tmp_path):
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "serve", "--base-url", "http://127.0.0.1:9",
                           "--tokenizer", "x", "--out", str(tmp_path / "x.json")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "tandem bench: error" in done.stderr and "Traceback" not in done.stderr


def test_multi_turn_sessions_grow_and_reuse_their_prefix(cluster, tmp_path):
    out = tmp_path / "turns.json"
    done = bench(cluster, out, "--dataset", "multi-turn", "--multi-turn-sessions", "3", "--multi-turn-turns", "3",
                 "--multi-turn-system-len", "24", "--multi-turn-user-len", "8", "--multi-turn-output-len", "4",
                 "--multi-turn-session-rate", "2", "--seed", "5", "--multi-turn-think-time", "0.05")
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["benchmark"] == "serve_multi_turn" and report["completed_turns"] == 9 and not report["errors"]
    turns = report["per_turn"]
    # each turn repeats the last prompt and its answer: 24 + 8, then + 4 + 8 per turn
    assert [turns[t]["prompt_tokens"] for t in ("1", "2", "3")] == [3 * 32, 3 * 44, 3 * 56]
    assert turns["3"]["cached_tokens"] >= 3 * 40  # the blocks of turn 2's prompt and answer (page 4)
    server = report["tandem"]
    assert server["leak_check"] == "pass" and server["requests_by_outcome"]["ok"] == 9
    assert 0 < server["prefix_hit_rate_decode"] <= 1
    # the prefill worker ran less than every prompt token (the shared system prompt is cached), and, with
    # the answers it warmed up in idle steps (only the decode worker computed them for the client), at
    # least what the decode worker lacked. That needs a session's first turn to reach the decode worker after
    # the previous session's shared blocks did: seed 5 starts the sessions 0.38 and 0.65 s apart (at 20 a
    # second, seed 0's were 1 ms apart, and a busy machine's suite saw the prefill worker's cached blocks
    # reach a decode worker that lacked them, computed nowhere in this run)
    computed = sum(server["prompt_tokens_computed_per_request"].values()) * 9
    warmed = sum(server["warmup_tokens_computed_per_request"].values()) * 9
    prompt_tokens = sum(turns[t]["prompt_tokens"] for t in turns)
    assert computed < prompt_tokens and warmed > 0
    assert prompt_tokens - sum(turns[t]["cached_tokens"] for t in turns) <= computed + warmed
    assert "prompt tokens computed" in done.stdout
