"""A quantized checkpoint in a cluster of different tensor-parallel layouts: 1P(TP 2) + 1D(TP 1) serving an fp8
(compressed-tensors, per-channel) Llama, every prompt prefilled remotely. Each prefill rank reads its slice of the
fp8 weights and of their scales through the launcher's real path; fp8 runs dequantized on the CPU, so greedy output
through the router equals transformers running the dequantized weights, token for token, and the KV bytes moved
are a TP 1 -> TP 1 transfer's."""

from __future__ import annotations

import pytest

from tests.cluster.test_tensor_parallel_cluster import worker_entry
from tests.cluster.test_tensor_parallel_pd import check_remote_prefill_and_bytes, start
from tests.quantized_checkpoints import quantized_checkpoint  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_checkpoint, quantized_checkpoint):  # noqa: F811
    return quantized_checkpoint("fp8_channel_dynamic", tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def fp8_prefill_tp2(fp8_checkpoint, tmp_path_factory):
    with start(fp8_checkpoint[0], tmp_path_factory, 1, {"prefill-0": 2}) as cluster:
        yield cluster


def test_a_two_rank_prefill_worker_serves_an_fp8_checkpoint(fp8_prefill_tp2, fp8_checkpoint, hf_reference):
    model, tokenizer = hf_reference(fp8_checkpoint[1])
    assert len(worker_entry(fp8_prefill_tp2.url, "prefill-0")["rank_pids"]) == 1
    check_remote_prefill_and_bytes(fp8_prefill_tp2, model, tokenizer, ["decode-0"])
