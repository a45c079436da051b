"""A Gemma 3 checkpoint (local layers with an 8-token window among global ones) served by real processes:
colocated, and 1P1D with every prompt prefilled on the prefill worker and its KV sent to the decode worker.
Prompts are longer than the window. Greedy completions must be transformers' own, token for token, with its
logprobs (1e-4); afterwards every KV block is back."""

from __future__ import annotations

import time

import pytest

from tests.cluster.conftest import CLUSTER_CONFIG, openai_client, running_cluster, wait_for_idle_blocks, worker_metric
from tests.conftest import hf_greedy, hf_logprobs
from tests.gemma_checkpoints import gemma3_checkpoint  # noqa: F401 (a fixture)

SHAPES = {
    "colocated": dict(num_prefill=0, num_decode=0, num_colocated=1),
    "1p1d": dict(num_prefill=1, num_decode=1),  # router.max_local_prefill_length 0: no prompt prefilled locally
}
PROMPTS = [
    "Paged attention keeps the key and value cache in fixed-size blocks, so memory is never fragmented.",
    "Once upon a time, in a small town by the sea, there lived a baker who rose before the sun.",
    "def main():\n",
]
NUM_NEW_TOKENS = 12
COMPUTED = "tandem_worker_prompt_tokens_computed_total"


@pytest.fixture(scope="module", params=list(SHAPES))
def cluster(request, gemma3_checkpoint, tmp_path_factory):
    with running_cluster(gemma3_checkpoint("gemma3"), tmp_path_factory.mktemp(f"gemma3-{request.param}"),
                         **SHAPES[request.param]) as running:
        yield request.param, running


def test_greedy_completions_match_transformers(cluster, gemma3_checkpoint, hf_reference):
    shape, running = cluster
    model, tokenizer = hf_reference(gemma3_checkpoint("gemma3"))
    client = openai_client(running)
    name = client.models.list().data[0].id
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    assert max(map(len, prompt_ids)) > 2 * model.config.sliding_window
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
