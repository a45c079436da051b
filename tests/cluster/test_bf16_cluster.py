"""A bf16 model served by `tandem up` 1P1D: every prompt prefilled on the prefill worker, its bf16 KV sent to the
decode worker, whose decode steps run the decoder layers in one native call where the CPU has the panel GEMM
(kernels/cpu_decoder_stack.py; its log says so). The same kernels compute the same bits in any process, so the
greedy completions and their logprobs are the offline bf16 engine's; afterwards every KV block is back."""

from __future__ import annotations

import pytest

from kernels import cpu_native
from pipeline import LLM
from tests.cluster.conftest import CLUSTER_CONFIG, check_served_1p1d_matches_offline, running_cluster

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
    check_served_1p1d_matches_offline(cluster, offline, PROMPTS, NUM_NEW_TOKENS, atol=1e-5)
    if cpu_native.ops is not None and cpu_native.ops.moe_gemm_isa() is not None:  # a CPU with AVX512-BF16
        decode_log = next(path for path in cluster.log_dir.glob("*.log") if "decode" in path.stem).read_text()
        assert "decoder layers: one native call per step" in decode_log
