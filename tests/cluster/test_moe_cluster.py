"""A mixture-of-experts checkpoint (Qwen3-MoE, a dense layer among sparse ones) served by real processes:
colocated, and 1P1D with every prompt prefilled on the prefill worker and its KV sent to the decode
worker. Greedy completions must be transformers' own, token for token, with its logprobs (1e-4); afterwards
every KV block is back."""

from __future__ import annotations

import time

import pytest

from tests.cluster.conftest import CLUSTER_CONFIG, openai_client, running_cluster, wait_for_idle_blocks, worker_metric
from tests.conftest import hf_greedy, hf_logprobs
from tests.moe_checkpoints import moe_checkpoint  # noqa: F401 (a fixture)

SHAPES = {
    "colocated": dict(num_prefill=0, num_decode=0, num_colocated=1),
    "1p1d": dict(num_prefill=1, num_decode=1),  # router.max_local_prefill_length 0: no prompt prefilled locally
}
PROMPTS = ["Hello there, how are you?", "The quick brown fox", "def main():\n"]
NUM_NEW_TOKENS = 12
COMPUTED = "tandem_worker_prompt_tokens_computed_total"


@pytest.fixture(scope="module", params=list(SHAPES))
def cluster(request, moe_checkpoint, tmp_path_factory):
    with running_cluster(moe_checkpoint("qwen3_moe"), tmp_path_factory.mktemp(f"moe-{request.param}"),
                         **SHAPES[request.param]) as running:
        yield request.param, running


def test_greedy_completions_match_transformers(cluster, moe_checkpoint, hf_reference):
    shape, running = cluster
    model, tokenizer = hf_reference(moe_checkpoint("qwen3_moe"))
    client = openai_client(running)
    name = client.models.list().data[0].id
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    for ids in prompt_ids:
        want = hf_greedy(model, ids, NUM_NEW_TOKENS, ignore_eos=False)
        out = client.completions.create(model=name, prompt=ids, max_tokens=NUM_NEW_TOKENS, temperature=0,
                                        logprobs=1, extra_body={"return_tokens_as_token_ids": True})
        choice = out.choices[0]
        assert [int(token.split(":")[1]) for token in choice.logprobs.tokens] == want  # "token_id:N"
        assert choice.text == tokenizer.decode(want, skip_special_tokens=True)
        reference = hf_logprobs(model, ids + want)[len(ids) - 1 : -1]  # [len(want), vocab]
        assert max(abs(logprob - reference[step, token].item())
                   for step, (token, logprob) in enumerate(zip(want, choice.logprobs.token_logprobs))) < 1e-4
    if shape == "1p1d":  # every prompt ran on the prefill worker, none on the decode worker (reports lag a beat)
        deadline = time.monotonic() + 5
        while (worker_metric(running.url, COMPUTED, "prefill-0") or 0) < sum(map(len, prompt_ids)):
            assert time.monotonic() < deadline, "the prefill worker did not prefill every prompt"
            time.sleep(0.1)
        assert not worker_metric(running.url, COMPUTED, "decode-0")
    wait_for_idle_blocks(running.url, running.worker_names, CLUSTER_CONFIG["kv_cache"]["num_blocks"])
