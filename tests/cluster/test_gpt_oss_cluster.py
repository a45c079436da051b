"""A gpt-oss checkpoint (attention sinks, 8-token sliding windows among full layers, biased experts) served by
real processes: by one colocated worker, and by a 1P1D cluster in which prompts longer than 6 tokens are
prefilled on the prefill worker and their KV sent to the decode worker, while shorter ones the decode worker
prefills itself. Greedy completions must be transformers' own, token for token, with its logprobs (1e-4), in
both shapes; afterwards every KV block is back. The sliding layers' KV outside their window is never sent."""

from __future__ import annotations

import time

import pytest

from tests.cluster.conftest import (check_greedy_against_transformers, check_prompt_tokens_computed, running_cluster,
                                    windowed_kv_bytes, worker_metric)
from tests.gpt_oss_checkpoints import SLIDING_LAYERS, gpt_oss_checkpoint  # noqa: F401 (a fixture)

MAX_LOCAL_PREFILL_LENGTH = 6
LONG_PROMPTS = [
    "Paged attention keeps the key and value cache in fixed-size blocks, so memory is never fragmented.",
    "Once upon a time, in a small town by the sea, there lived a baker who rose before the sun.",
]
SHORT_PROMPT = "Hello there"
NUM_NEW_TOKENS = 10


@pytest.fixture(scope="module")
def cluster(gpt_oss_checkpoint, tmp_path_factory):
    config = {"router": {"max_local_prefill_length": MAX_LOCAL_PREFILL_LENGTH}}
    with running_cluster(gpt_oss_checkpoint("gpt_oss"), tmp_path_factory.mktemp("gpt-oss-1p1d"), num_prefill=1,
                         num_decode=1, config=config) as running:
        yield running


def test_remote_and_local_prefill_match_transformers(cluster, gpt_oss_checkpoint, hf_reference):
    model, tokenizer = hf_reference(gpt_oss_checkpoint("gpt_oss"))
    long_ids = [tokenizer(prompt)["input_ids"] for prompt in LONG_PROMPTS]
    short_ids = tokenizer(SHORT_PROMPT)["input_ids"]
    assert min(map(len, long_ids)) > 2 * model.config.sliding_window
    assert len(short_ids) <= MAX_LOCAL_PREFILL_LENGTH
    check_greedy_against_transformers(cluster, model, tokenizer, [*long_ids, short_ids], NUM_NEW_TOKENS,
                                      is_remote_prefill=False)  # checks the completions and every block back
    # the long prompts were prefilled remotely, the short one locally
    check_prompt_tokens_computed(cluster.url, "prefill-0", sum(map(len, long_ids)))
    check_prompt_tokens_computed(cluster.url, "decode-0", len(short_ids))
    # the sliding layers' blocks outside their window stayed on the prefill worker
    sizes = [windowed_kv_bytes(model.config, SLIDING_LAYERS["gpt_oss"], len(ids)) for ids in long_ids]
    windowed, whole = sum(size[0] for size in sizes), sum(size[1] for size in sizes)
    assert windowed < whole
    deadline = time.monotonic() + 5
    while worker_metric(cluster.url, "tandem_kv_transfer_bytes_total", "prefill-0") != windowed:
        assert time.monotonic() < deadline, (
            f"prefill-0 sent {worker_metric(cluster.url, 'tandem_kv_transfer_bytes_total', 'prefill-0')} KV bytes, "
            f"{windowed} expected ({whole} with every layer whole)")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def colocated_cluster(gpt_oss_checkpoint, tmp_path_factory):
    with running_cluster(gpt_oss_checkpoint("gpt_oss"), tmp_path_factory.mktemp("gpt-oss-colocated"), num_prefill=0,
                         num_decode=0, num_colocated=1) as running:
        yield running


def test_a_colocated_worker_matches_transformers(colocated_cluster, gpt_oss_checkpoint, hf_reference):
    """The PrefillAndDecode role: one worker prefills (past the window) and decodes, transformers' tokens."""
    model, tokenizer = hf_reference(gpt_oss_checkpoint("gpt_oss"))
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in [*LONG_PROMPTS, SHORT_PROMPT]]
    check_greedy_against_transformers(colocated_cluster, model, tokenizer, prompt_ids, NUM_NEW_TOKENS,
                                      is_remote_prefill=False)
