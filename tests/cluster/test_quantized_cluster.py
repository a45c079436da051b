"""An int8 W8A8 checkpoint (compressed-tensors int-quantized) served by `tandem up` 1P1D: every prompt prefilled
on the prefill worker and its KV sent to the decode worker. The int8 layers quantize each token's activations on
their own and accumulate in int32, so the greedy completions and their logprobs are the offline engine's on the
same checkpoint (1e-4); afterwards every KV block is back."""

from __future__ import annotations

import pytest

from pipeline import LLM
from tests.cluster.conftest import check_served_1p1d_matches_offline, running_cluster
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
    check_served_1p1d_matches_offline(cluster, offline, PROMPTS, NUM_NEW_TOKENS, atol=1e-4)
