"""An int8 W8A8 checkpoint (compressed-tensors int-quantized) served by `tandem up` 1P1D: every prompt prefilled
on the prefill worker and its KV sent to the decode worker. The int8 layers quantize each token's activations on
their own and accumulate in int32, so the greedy completions and their logprobs are the offline engine's on the
same checkpoint (1e-4); afterwards every KV block is back."""

from __future__ import annotations

import time

import pytest

from pipeline import LLM, SamplingParams
from tests.cluster.conftest import (CLUSTER_CONFIG, PROMPT_TOKENS_COMPUTED, model_name, openai_client, running_cluster,
                                    wait_for_idle_blocks, worker_metric)
from tests.quantized_checkpoints import quantized_checkpoint  # noqa: F401 (a fixture)

PROMPTS = [[5, 17, 230, 41, 99, 12, 7], [260, 3, 88, 150]]
NUM_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def int8_checkpoint(tiny_checkpoint, quantized_checkpoint):
    return quantized_checkpoint("w8a8_int8_channel", tiny_checkpoint("llama"))[0]


@pytest.fixture(scope="module")
def cluster(int8_checkpoint, tmp_path_factory):
    with running_cluster(int8_checkpoint, tmp_path_factory.mktemp("int8-1p1d"), num_prefill=1, num_decode=1) as running:
        yield running


def test_int8_checkpoint_served_1p1d_matches_the_offline_engine(cluster, int8_checkpoint):
    offline = LLM(int8_checkpoint, kv_cache={"page_size": 4, "num_blocks": 64})
    want = offline.generate(PROMPTS, SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, logprobs=0))
    client = openai_client(cluster)
    name = model_name(client)
    for prompt, expected in zip(PROMPTS, want):
        out = client.completions.create(model=name, prompt=prompt, max_tokens=NUM_NEW_TOKENS, temperature=0,
                                        logprobs=1, extra_body={"return_tokens_as_token_ids": True})
        choice = out.choices[0]
        assert [int(token.split(":")[1]) for token in choice.logprobs.tokens] == expected.token_ids
        want_logprobs = [entry[token] for token, entry in zip(expected.token_ids, expected.logprobs)]
        assert max(abs(a - b) for a, b in zip(choice.logprobs.token_logprobs, want_logprobs)) < 1e-4
    deadline = time.monotonic() + 5  # reports lag a heartbeat
    while (worker_metric(cluster.url, PROMPT_TOKENS_COMPUTED, "prefill-0") or 0) < sum(map(len, PROMPTS)):
        assert time.monotonic() < deadline, "the prefill worker did not prefill every prompt"
        time.sleep(0.1)
    assert not worker_metric(cluster.url, PROMPT_TOKENS_COMPUTED, "decode-0")
    wait_for_idle_blocks(cluster.url, cluster.worker_names, CLUSTER_CONFIG["kv_cache"]["num_blocks"])
