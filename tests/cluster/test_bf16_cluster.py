"""A bf16 model served by `tandem up` 1P1D: every prompt prefilled on the prefill worker, its bf16 KV sent to the
decode worker, whose decode steps run the decoder layers in one native call where the CPU has the panel GEMM
(kernels/cpu_decoder_stack.py; its log says so). The same kernels compute the same bits in any process, so the
greedy completions and their logprobs are the offline bf16 engine's; afterwards every KV block is back."""

from __future__ import annotations

import time

import pytest

from kernels import cpu_native
from pipeline import LLM, SamplingParams
from tests.cluster.conftest import (CLUSTER_CONFIG, PROMPT_TOKENS_COMPUTED, model_name, openai_client, running_cluster,
                                    wait_for_idle_blocks, worker_metric)

PROMPTS = [[5, 17, 230, 41, 99, 12, 7], [260, 3, 88, 150], list(range(20, 90))]
NUM_NEW_TOKENS = 10
BF16 = {"model": {"dtype": "bfloat16"}}


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, tmp_path_factory):
    with running_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp("bf16-1p1d"), num_prefill=1, num_decode=1,
                         config=BF16) as running:
        yield running


def test_bf16_served_1p1d_matches_the_offline_bf16_engine(cluster, tiny_checkpoint):
    offline = LLM(tiny_checkpoint("llama"), model_config={"dtype": "bfloat16"},
                  kv_cache={"page_size": CLUSTER_CONFIG["kv_cache"]["page_size"], "num_blocks": 64})
    want = offline.generate(PROMPTS, SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, logprobs=0))
    client = openai_client(cluster)
    name = model_name(client)
    for prompt, expected in zip(PROMPTS, want):
        out = client.completions.create(model=name, prompt=prompt, max_tokens=NUM_NEW_TOKENS, temperature=0,
                                        logprobs=1, extra_body={"return_tokens_as_token_ids": True})
        choice = out.choices[0]
        assert [int(token.split(":")[1]) for token in choice.logprobs.tokens] == expected.token_ids
        want_logprobs = [entry[token] for token, entry in zip(expected.token_ids, expected.logprobs)]
        assert max(abs(a - b) for a, b in zip(choice.logprobs.token_logprobs, want_logprobs)) < 1e-5
    deadline = time.monotonic() + 5  # reports lag a heartbeat
    while (worker_metric(cluster.url, PROMPT_TOKENS_COMPUTED, "prefill-0") or 0) < sum(map(len, PROMPTS)):
        assert time.monotonic() < deadline, "the prefill worker did not prefill every prompt"
        time.sleep(0.1)
    assert not worker_metric(cluster.url, PROMPT_TOKENS_COMPUTED, "decode-0")
    wait_for_idle_blocks(cluster.url, cluster.worker_names, CLUSTER_CONFIG["kv_cache"]["num_blocks"])
    if cpu_native.ops is not None and cpu_native.ops.moe_gemm_isa() is not None:  # a CPU with AVX512-BF16
        decode_log = next(path for path in cluster.log_dir.glob("*.log") if "decode" in path.stem).read_text()
        assert "decoder layers: one native call per step" in decode_log
