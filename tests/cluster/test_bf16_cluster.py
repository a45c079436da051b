"""A bf16 model (Llama; Gemma 3, whose local layers send their window only) served by `tandem up` 1P1D: every prompt prefilled on the prefill worker, its bf16 KV sent to the
decode worker, whose decode steps run the decoder layers in one native call where the CPU has the panel GEMM
(kernels/cpu_decoder_stack.py; its log says so). The same kernels compute the same bits in any process, so the
greedy completions and their logprobs are the offline bf16 engine's; afterwards every KV block is back."""

from __future__ import annotations

import pytest

from kernels import cpu_native, cpu_paged_attention
from pipeline import LLM
from tests.cluster.conftest import CLUSTER_CONFIG, check_served_1p1d_matches_offline, running_cluster
from tests.gemma_checkpoints import gemma3_checkpoint  # noqa: F401 (a fixture)

PROMPTS = [[5, 17, 230, 41, 99, 12, 7], [260, 3, 88, 150], list(range(20, 90))]
NUM_NEW_TOKENS = 10
BF16 = {"model": {"dtype": "bfloat16"}}


@pytest.fixture(scope="module")
def same_routes_everywhere():
    """Every process (the workers, this one's offline engine) takes the same kernels: on an AMX CPU each would measure
    its own routes at load (the bf16 GEMM, the prompt attention), and two measurements may differ; fixed here as a CPU
    without AMX runs them (the panel GEMM where the CPU has it, prompts on the native attention)."""
    with pytest.MonkeyPatch.context() as patch:
        if cpu_native.ops is not None and cpu_native.ops.moe_gemm_isa() is not None:  # a CPU with AVX512-BF16
            patch.setenv("TANDEM_CPU_BF16_GEMM", "panels")
        patch.setenv("TANDEM_CPU_FLASH_MIN_QUERY_ROWS", "off")  # the workers read it at import; this process is set
        patch.setattr(cpu_paged_attention, "FLASH_MIN_QUERY_ROWS", None)
        patch.setattr(cpu_paged_attention, "FLASH_ROUTE_SOURCE", "set")
        yield


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def checkpoint(request, tiny_checkpoint, gemma3_checkpoint) -> str:
    return gemma3_checkpoint("gemma3") if request.param == "gemma3" else tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def cluster(same_routes_everywhere, checkpoint, tmp_path_factory):
    with running_cluster(checkpoint, tmp_path_factory.mktemp("bf16-1p1d"), num_prefill=1, num_decode=1,
                         config=BF16) as running:
        yield running


def test_bf16_served_1p1d_matches_the_offline_bf16_engine(same_routes_everywhere, cluster, checkpoint):
    offline = LLM(checkpoint, model_config={"dtype": "bfloat16"},
                  kv_cache={"page_size": CLUSTER_CONFIG["kv_cache"]["page_size"], "num_blocks": 64})
    check_served_1p1d_matches_offline(cluster, offline, PROMPTS, NUM_NEW_TOKENS, atol=1e-5)
    if cpu_native.ops is not None and cpu_native.ops.moe_gemm_isa() is not None:  # a CPU with AVX512-BF16
        decode_log = next(path for path in cluster.log_dir.glob("*.log") if "decode" in path.stem).read_text()
        assert "decoder layers: one native call per step" in decode_log
