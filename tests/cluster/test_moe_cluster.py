"""Mixture-of-experts checkpoints (Qwen3-MoE with a dense layer among sparse ones; Mixtral) served by real processes:
colocated, and 1P1D with every prompt prefilled on the prefill worker and its KV sent to the decode
worker. Greedy completions must be transformers' own, token for token, with its logprobs (1e-4); afterwards
every KV block is back."""

from __future__ import annotations

import pytest

from tests.cluster.conftest import check_greedy_against_transformers, running_cluster
from tests.moe_checkpoints import moe_checkpoint  # noqa: F401 (a fixture)

SHAPES = {
    "colocated": dict(num_prefill=0, num_decode=0, num_colocated=1),
    "1p1d": dict(num_prefill=1, num_decode=1),  # router.max_local_prefill_length 0: no prompt prefilled locally
}
PROMPTS = ["Hello there, how are you?", "The quick brown fox", "def main():\n"]
NUM_NEW_TOKENS = 12


@pytest.fixture(scope="module", params=[(family, shape) for family in ("qwen3_moe", "mixtral") for shape in SHAPES],
                ids=lambda param: "-".join(param))
def cluster(request, moe_checkpoint, tmp_path_factory):
    family, shape = request.param
    with running_cluster(moe_checkpoint(family), tmp_path_factory.mktemp(f"moe-{family}-{shape}"),
                         **SHAPES[shape]) as running:
        yield family, shape, running


def test_greedy_completions_match_transformers(cluster, moe_checkpoint, hf_reference):
    family, shape, running = cluster
    model, tokenizer = hf_reference(moe_checkpoint(family))
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    check_greedy_against_transformers(running, model, tokenizer, prompt_ids, NUM_NEW_TOKENS,
                                      is_remote_prefill=shape == "1p1d")
