"""``tandem generate`` as a user runs it (a process of its own): JSONL in and out, speculation and tensor
parallelism from the command line, and bad input as one clear line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import hf_greedy


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=240)


def test_cli_generate_jsonl_roundtrip(tmp_path, tiny_checkpoint):
    """A request's fields beat the flags; what neither sets comes from the config's sampling section (here by
    flag; a file or a TANDEM_SAMPLING__* variable alike), as in the LLM API: it used to be dropped for
    SamplingParams' own defaults (16 tokens, temperature 1)."""
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in (
        {"prompt": "Hello"}, {"prompt": "Hello"}, {"prompt_token_ids": [5, 6, 7], "max_tokens": 3})))
    target = tmp_path / "out.jsonl"
    result = run_cli("generate", "--model", tiny_checkpoint("llama"), "--input", str(source), "--output",
                     str(target), "--sampling-max-tokens", "5", "--sampling-temperature", "0", "--ignore-eos",
                     "--kv-cache-num-blocks", "64")
    assert result.returncode == 0, result.stderr
    assert "speculative" not in result.stderr  # the acceptance line is for a speculative run only
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert [len(r["token_ids"]) for r in rows] == [5, 5, 3]
    assert rows[0]["finish_reason"] == "length" and rows[0]["token_ids"] == rows[1]["token_ids"]  # greedy


def test_cli_generate_with_a_draft_model_reports_acceptance(tmp_path, tiny_checkpoint, hf_reference):
    speculative = run_cli("generate", "--model", tiny_checkpoint("llama"), "Hello", "--max-tokens", "12",
                          "--temperature", "0", "--ignore-eos", "--kv-cache-num-blocks", "64", "--no-progress",
                          "--speculative-num-speculative-tokens", "3")  # no draft path: the target drafts for itself
    assert speculative.returncode == 0, speculative.stderr
    model, tokenizer = hf_reference(tiny_checkpoint("llama"))  # transformers' greedy tokens on the same weights
    assert json.loads(speculative.stdout)["token_ids"] == hf_greedy(model, tokenizer("Hello").input_ids, 12)
    assert "draft tokens accepted (100%)" in speculative.stderr


def test_cli_generate_tensor_parallel_forks_its_ranks_warm(tiny_checkpoint, hf_reference):
    """With --tensor-parallel-size 2, rank 1 is forked from the generate process once it has imported what a rank
    needs, before torch runs anything there (not started from the fork server, which pays an interpreter's imports
    first); the tokens are transformers' own."""
    result = run_cli("--log-level", "INFO", "generate", "--model", tiny_checkpoint("llama"), "Hello",
                     "--max-tokens", "8", "--temperature", "0", "--ignore-eos", "--kv-cache-num-blocks", "64",
                     "--no-progress", "--tensor-parallel-size", "2")
    assert result.returncode == 0, result.stderr
    model, tokenizer = hf_reference(tiny_checkpoint("llama"))
    assert json.loads(result.stdout)["token_ids"] == hf_greedy(model, tokenizer("Hello").input_ids, 8)
    assert "1 rank process(es) forked, waiting for their group" in result.stderr
    assert "starts from the fork server" not in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-batch-size", "-3"], "max_batch_size: Input should be greater than or equal to 1"),
        (["--max-tokens", "0"], "max_tokens: must be >= 1"),
        (["--temperature", "-1"], "temperature: must be >= 0"),
        (["--model", "/nonexistent/dir"], "/nonexistent/dir"),
    ],
)
def test_cli_bad_input_is_one_clear_line(args, message, tiny_checkpoint):
    base = ["generate", "hello"]
    if "--model" not in args:
        base += ["--model", tiny_checkpoint("llama")]
    result = run_cli(*base, *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
