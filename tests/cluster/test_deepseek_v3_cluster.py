"""DeepSeek-V3 (latent attention, grouped-routed experts with shared experts, a dense first layer) served by
real processes: colocated, and 1P1D with every prompt prefilled on the prefill worker and its latent KV blocks
sent to the decode worker (the handshake's layout record says "latent"). Greedy completions must be
transformers' own, token for token, with its logprobs (1e-4); afterwards every KV block is back."""

from __future__ import annotations

import time

import pytest

from tests.cluster.conftest import CLUSTER_CONFIG, check_greedy_against_transformers, running_cluster, worker_metric
from tests.deepseek_checkpoints import deepseek_checkpoint  # noqa: F401 (a fixture)

SHAPES = {
    "colocated": dict(num_prefill=0, num_decode=0, num_colocated=1),
    "1p1d": dict(num_prefill=1, num_decode=1),  # router.max_local_prefill_length 0: no prompt prefilled locally
}
PROMPTS = ["Hello there, how are you?", "The quick brown fox"]
NUM_NEW_TOKENS = 10


@pytest.fixture(scope="module", params=list(SHAPES))
def cluster(request, deepseek_checkpoint, tmp_path_factory):
    with running_cluster(deepseek_checkpoint("deepseek_v3"), tmp_path_factory.mktemp(f"dsv3-{request.param}"),
                         **SHAPES[request.param]) as running:
        yield request.param, running


def test_greedy_completions_match_transformers(cluster, deepseek_checkpoint, hf_reference):
    shape, running = cluster
    model, tokenizer = hf_reference(deepseek_checkpoint("deepseek_v3"))
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    check_greedy_against_transformers(running, model, tokenizer, prompt_ids, NUM_NEW_TOKENS,
                                      is_remote_prefill=shape == "1p1d")

    if shape == "1p1d":  # what crossed was latent rows: (kv_lora_rank + qk_rope_head_dim) per token and layer
        config, page_size = model.config, CLUSTER_CONFIG["kv_cache"]["page_size"]
        latent_block_bytes = config.num_hidden_layers * page_size * (config.kv_lora_rank + config.qk_rope_head_dim) * 4
        want = sum(-(-len(ids) // page_size) for ids in prompt_ids) * latent_block_bytes  # fp32 on CPU
        deadline = time.monotonic() + 5  # reports lag a heartbeat
        while worker_metric(running.url, "tandem_kv_transfer_bytes_total", "prefill-0") != want:
            assert time.monotonic() < deadline, (
                f"prefill-0 sent {worker_metric(running.url, 'tandem_kv_transfer_bytes_total', 'prefill-0')} KV bytes, "
                f"{want} expected")
            time.sleep(0.1)
