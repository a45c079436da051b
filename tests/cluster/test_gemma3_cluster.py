"""A Gemma 3 checkpoint (local layers with an 8-token window among global ones) served by real processes:
colocated, and 1P1D with every prompt prefilled on the prefill worker and its KV sent to the decode worker.
Prompts are longer than the window. Greedy completions must be transformers' own, token for token, with its
logprobs (1e-4); afterwards every KV block is back."""

from __future__ import annotations

import pytest

from tests.cluster.conftest import check_greedy_against_transformers, running_cluster
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


@pytest.fixture(scope="module", params=list(SHAPES))
def cluster(request, gemma3_checkpoint, tmp_path_factory):
    with running_cluster(gemma3_checkpoint("gemma3"), tmp_path_factory.mktemp(f"gemma3-{request.param}"),
                         **SHAPES[request.param]) as running:
        yield request.param, running


def test_greedy_completions_match_transformers(cluster, gemma3_checkpoint, hf_reference):
    shape, running = cluster
    model, tokenizer = hf_reference(gemma3_checkpoint("gemma3"))
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    assert max(map(len, prompt_ids)) > 2 * model.config.sliding_window
    check_greedy_against_transformers(running, model, tokenizer, prompt_ids, NUM_NEW_TOKENS,
                                      is_remote_prefill=shape == "1p1d")
