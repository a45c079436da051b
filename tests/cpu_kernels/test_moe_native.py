"""The one-call MoE expert GEMM (``kernels/cpu_moe.py``, ``kernels/native/moe_gemm.h``) against a float64 torch
product of the same grouped rows, on every body this CPU runs (AVX512-BF16 where the CPU has it, the portable one
everywhere): within the one rounding to bf16 plus fp32 summation error, and within one bf16 step of the per-expert
oneDNN path it replaces; ``StackedExperts`` through it against its per-expert loop; gpt-oss's biased experts
through it against the reference."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_moe, cpu_native, load_kernels
from kernels.cpu_gemm import CpuLinear
from tests.gpt_oss_checkpoints import gpt_oss_checkpoint  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(cpu_native.ops is None, reason="kernels._cpu_ops is not built")

MOE_BODIES = cpu_native.ops.supported_moe_gemm_isas() if cpu_native.ops is not None else []


@pytest.fixture(params=MOE_BODIES)
def moe_body(request):
    """Each MoE GEMM body this CPU runs (the portable one on every CPU), restored afterwards."""
    before = cpu_native.ops.moe_gemm_isa()
    cpu_native.ops.set_moe_gemm_isa(request.param)
    yield request.param
    cpu_native.ops.set_moe_gemm_isa(before)


def grouped_case(rows_per_expert: list[int], k: int, n: int, seed: int = 0):
    """Rows grouped by expert, the experts' bf16 weights ``[E, n, k]``, and the int64 offsets."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.tensor(rows_per_expert, dtype=torch.int64)
    rows = torch.randn(int(counts.sum()), k, generator=generator).to(torch.bfloat16)  # [num_rows, k]
    weights = (torch.randn(len(rows_per_expert), n, k, generator=generator) / k**0.5).to(torch.bfloat16)
    offsets = torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0))
    return rows, weights, offsets


def exact_products(rows, weights, offsets):
    """float64 products of each expert's rows with its weight, and their sums of |terms| (the fp32 error scale)."""
    exact = torch.empty(rows.shape[0], weights.shape[1], dtype=torch.float64)
    magnitude = torch.empty_like(exact)
    for expert in range(weights.shape[0]):
        start, end = int(offsets[expert]), int(offsets[expert + 1])
        x, w = rows[start:end].double(), weights[expert].double()
        exact[start:end] = x @ w.T
        magnitude[start:end] = x.abs() @ w.abs().T
    return exact, magnitude


def assert_within_one_rounding(out, exact, magnitude, k):
    """|out - exact| <= half a bf16 step of |exact| (2^-8 |exact|) + fp32 summation error (k 2^-23 sum|terms|)."""
    bound = exact.abs() * 2.0**-8 + magnitude * (k * 2.0**-23) + 1e-30
    excess = (out.double() - exact).abs() - bound
    assert excess.max().item() <= 0, f"worst excess {excess.max().item():.3g}"


# rows 1..17 per expert (decode batches and the 8-row tile's tails), experts with no rows, K odd and even, N off the
# 32-column panel and the 16-column vector
SHAPES = [([1], 1, 1), ([3, 0, 2], 7, 33), ([0, 17, 1, 0], 64, 48), ([5, 8, 9, 16, 0, 4], 129, 100),
          (list(range(18)), 96, 65), ([2, 0, 0, 3], 768, 768), ([11, 6], 384, 768), ([0, 0, 1], 31, 31)]


@pytest.mark.parametrize("rows_per_expert,k,n", SHAPES)
def test_grouped_gemm_is_the_grouped_product(moe_body, threads, rows_per_expert, k, n):
    rows, weights, offsets = grouped_case(rows_per_expert, k, n)
    out = cpu_moe.grouped_gemm(rows, offsets, cpu_moe.pack(weights))
    assert out.dtype == torch.bfloat16 and out.shape == (rows.shape[0], n)
    exact, magnitude = exact_products(rows, weights, offsets)
    assert_within_one_rounding(out, exact, magnitude, k)


@pytest.mark.parametrize("rows_per_expert, k, n", [([3, 0, 2], 7, 33), ([5, 8, 9, 16, 0, 4], 129, 100)])
def test_each_experts_bias_is_added_before_the_rounding(moe_body, threads, rows_per_expert, k, n):
    """gpt-oss's experts: expert e's rows get bias[e] (fp32 sums, then the one rounding); a bias for several experts
    without its stride is refused."""
    rows, weights, offsets = grouped_case(rows_per_expert, k, n, seed=3)
    bias = torch.randn(len(rows_per_expert), n).to(torch.bfloat16)
    packed = cpu_moe.pack(weights)
    out = cpu_moe.grouped_gemm(rows, offsets, packed, cpu_moe.padded_bias(bias, packed))
    exact, magnitude = exact_products(rows, weights, offsets)
    expert_of_row = torch.repeat_interleave(torch.arange(len(rows_per_expert)), torch.tensor(rows_per_expert))
    exact += bias.double()[expert_of_row]
    assert_within_one_rounding(out, exact, magnitude + bias.double().abs()[expert_of_row], k + 1)
    with pytest.raises(ValueError, match="bias_expert_stride"):
        cpu_native.ops.moe_gemm(rows.data_ptr(), packed.packed.data_ptr(), offsets.data_ptr(), out.data_ptr(),
                                len(rows_per_expert), rows.stride(0), out.stride(0), k, n, 1,
                                cpu_moe.padded_bias(bias, packed).data_ptr())


def test_grouped_gemm_reads_strided_rows(moe_body):
    """Rows that are a column slice of a wider tensor (a row stride past K)."""
    rows, weights, offsets = grouped_case([2, 5, 1], 40, 20)
    wide = torch.zeros(rows.shape[0], 64, dtype=torch.bfloat16)
    wide[:, 3:43] = rows
    out = cpu_moe.grouped_gemm(wide[:, 3:43], offsets, cpu_moe.pack(weights))
    assert torch.equal(out, cpu_moe.grouped_gemm(rows, offsets, cpu_moe.pack(weights)))


def test_grouped_gemm_is_within_one_bf16_step_of_onednn(moe_body, threads):
    """Against the per-expert packed oneDNN GEMMs it replaces (the layer's shape): the sums differ only in order,
    so the bf16 results differ by at most one step, and rarely."""
    rows, weights, offsets = grouped_case([3] * 8 + [1, 0, 16, 2], 768, 768, seed=1)
    out = cpu_moe.grouped_gemm(rows, offsets, cpu_moe.pack(weights))
    for expert in range(weights.shape[0]):
        start, end = int(offsets[expert]), int(offsets[expert + 1])
        if start == end:
            continue
        current = CpuLinear(weights[expert], None)(rows[start:end])
        step = current.float().abs().clamp_min(2.0**-100) * 2.0**-7
        assert ((out[start:end].float() - current.float()).abs() <= step).all()
        assert (out[start:end] != current).float().mean().item() < 0.05


def test_grouped_experts_declines_groups_past_the_limit_and_fp32(monkeypatch):
    monkeypatch.setattr(cpu_moe, "MAX_ROWS_PER_EXPERT", 4)  # as on an AMX CPU, where oneDNN takes larger groups
    rows, weights, offsets = grouped_case([5, 1], 16, 32)
    experts = cpu_moe.GroupedExperts(weights, weights.transpose(1, 2).contiguous())
    counts = offsets.diff()
    assert experts(rows, counts, lambda x: x) is None
    assert experts(rows[1:], counts - torch.tensor([1, 0]), lambda x: x) is not None
    monkeypatch.setattr(cpu_moe, "MAX_ROWS_PER_EXPERT", None)
    assert experts(rows, counts, lambda x: x) is not None
    assert experts(rows.float(), counts, lambda x: x) is None


def test_prefill_sized_groups_without_a_limit(moe_body, monkeypatch):
    """Without a limit (a CPU without AMX) the one call takes prefill-sized groups too, uneven ones included."""
    monkeypatch.setattr(cpu_moe, "MAX_ROWS_PER_EXPERT", None)
    rows, weights, offsets = grouped_case([300, 0, 17, 520], 96, 64, seed=3)
    _, down, _ = grouped_case([1], 32, 96, seed=4)  # [E, 96, 32]: back to the rows' width from half of 64
    down = down.expand(4, -1, -1).contiguous()
    experts = cpu_moe.GroupedExperts(weights, down)
    out = experts(rows, offsets.diff(), lambda x: x[:, : x.shape[1] // 2])  # a stand-in activation: the first half
    assert out is not None and out.shape == rows.shape
    gate_up = cpu_moe.grouped_gemm(rows, offsets, experts.gate_up)
    assert_within_one_rounding(gate_up, *exact_products(rows, weights, offsets), 96)
    hidden = gate_up[:, :32]
    exact, magnitude_down = exact_products(hidden, down, offsets)
    assert_within_one_rounding(out, exact, magnitude_down, 32)


def prepared_experts(gate_up: torch.Tensor, down: torch.Tensor, kernels, one_call: bool):
    """A bf16 ``StackedExperts`` with these weights, prepared by the CPU set with the one-call MoE GEMM on or off."""
    from pipeline.models.moe import MoeSpec, StackedExperts

    spec = MoeSpec(num_experts=8, top_k=2, intermediate_size=48, renormalize=True, weights_in_fp32=False,
                   block_name="mlp", projection_names=("gate_proj", "up_proj", "down_proj"))
    experts = StackedExperts(spec, 64, torch.bfloat16, "cpu")
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
    before = cpu_native.ops.moe_gemm_isa()
    if not one_call:
        cpu_native.ops.set_moe_gemm_isa(None)
    try:
        kernels.prepare_model(experts)
    finally:
        cpu_native.ops.set_moe_gemm_isa(before)
    return experts


@pytest.mark.parametrize("num_tokens", [1, 3, 12])
def test_stacked_experts_one_call_matches_per_expert_loop(moe_body, num_tokens):
    """A layer's experts through the one-call path against the same experts' per-expert oneDNN loop."""
    from kernels import cpu_moe
    from kernels.cpu_gemm import PACKED_MAX_ROWS

    generator = torch.Generator().manual_seed(2)
    gate_up, down = torch.randn(8, 96, 64, generator=generator) / 8, torch.randn(8, 64, 48, generator=generator) / 7
    kernels = load_kernels("cpu")
    experts = prepared_experts(gate_up, down, kernels, one_call=True)
    loop = prepared_experts(gate_up, down, kernels, one_call=False)
    assert experts.grouped_experts is not None and loop.grouped_experts is None
    if cpu_moe.MAX_ROWS_PER_EXPERT is None:
        # the one call takes every group: no per-expert GEMMs, and the stacked experts let go (held once)
        assert experts.expert_gemms is None and experts.gate_up_proj.is_meta and experts.down_proj.is_meta
        assert experts.gate_up_proj.shape == (8, 96, 64)
    else:
        # oneDNN's packed copies serve at most PACKED_MAX_ROWS rows: where the one call takes every such group they
        # would never be read, and are not made (experts held twice, not three times)
        packed_each = [gemm.packed is not None for pair in experts.expert_gemms for gemm in pair]
        takes_packed_rows = PACKED_MAX_ROWS is not None and cpu_moe.MAX_ROWS_PER_EXPERT >= PACKED_MAX_ROWS
        assert packed_each == [not takes_packed_rows] * len(packed_each)
    x = torch.randn(num_tokens, 64, generator=generator).to(torch.bfloat16)
    topk_weights = torch.softmax(torch.randn(num_tokens, 2, generator=generator), -1).to(torch.bfloat16)
    topk_ids = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(num_tokens)])
    fused = experts(x, topk_weights, topk_ids, kernels)
    looped = loop(x, topk_weights, topk_ids, kernels)
    torch.testing.assert_close(fused.float(), looped.float(), rtol=2 * 2.0**-8, atol=2e-3)


def test_bf16_model_generates_as_the_per_expert_loop(tmp_path):
    """A tiny Qwen3-MoE in bf16 through the engine, the one-call path (prefill chunks and decode) against the
    per-expert oneDNN loop: the same greedy tokens, each step's logprobs within bf16 noise."""
    from pipeline.builtin_model import build_checkpoint
    from pipeline.llm import LLM
    from tests.conftest import greedy
    from tests.moe_checkpoints import MOE_CONFIGS

    if cpu_native.ops.moe_gemm_isa() is None:
        pytest.skip("the one-call MoE GEMM does not run on this CPU")
    architecture, settings = MOE_CONFIGS["qwen3_moe"]
    path = build_checkpoint(tmp_path / "tiny-qwen3-moe", architecture, **settings)
    llm = LLM(model=path, kernel_backend="cpu", model_config={"dtype": "bfloat16"}, max_batch_input_tokens=16,
              kv_cache={"page_size": 4, "num_blocks": 96, "enable_prefix_caching": False})
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (length,), generator=generator).tolist() for length in (3, 29, 8, 1, 17)]
    fused = llm.generate(prompts, greedy(10, logprobs=1))
    before = cpu_native.ops.moe_gemm_isa()
    cpu_native.ops.set_moe_gemm_isa(None)  # an engine prepared without the one call: the per-expert loop
    try:
        loop_llm = LLM(model=path, kernel_backend="cpu", model_config={"dtype": "bfloat16"}, max_batch_input_tokens=16,
                       kv_cache={"page_size": 4, "num_blocks": 96, "enable_prefix_caching": False})
        looped = loop_llm.generate(prompts, greedy(10, logprobs=1))
    finally:
        cpu_native.ops.set_moe_gemm_isa(before)
    for ours, theirs in zip(fused, looped):
        assert ours.token_ids == theirs.token_ids
        for step_ours, step_theirs in zip(ours.logprobs, theirs.logprobs):
            token = next(iter(step_theirs))
            assert abs(step_ours[token] - step_theirs[token]) < 0.05


def test_gpt_oss_bf16_experts_in_one_call_generate_as_the_reference(gpt_oss_checkpoint, monkeypatch):
    """gpt-oss's biased experts and clamped SwiGLU in bf16: all experts' GEMMs in one call each, every expert's bias
    added before the rounding (the stacked weights let go where no group is declined), against the kernel set's
    per-expert reference over the stacked weights (an engine prepared without the one call): the same greedy
    tokens, each step's logprobs within bf16 noise."""
    from pipeline.llm import LLM
    from tests.conftest import greedy

    if cpu_native.ops.moe_gemm_isa() is None:
        pytest.skip("the one-call MoE GEMM does not run on this CPU")
    monkeypatch.setattr(cpu_moe, "MAX_ROWS_PER_EXPERT", None)  # as on a CPU without AMX: every group in one call
    path = gpt_oss_checkpoint("gpt_oss")
    settings = dict(kernel_backend="cpu", max_batch_input_tokens=16,
                    kv_cache={"page_size": 4, "num_blocks": 96, "enable_prefix_caching": False})
    llm = LLM(model=path, model_config={"dtype": "bfloat16"}, **settings)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.grouped_experts is not None and experts.gate_up_proj.device.type == "meta"
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 300, (length,), generator=generator).tolist() for length in (3, 29, 8, 1, 17)]
    fused = llm.generate(prompts, greedy(10, logprobs=1))
    reference_llm = LLM(model=path, model_config={"dtype": "bfloat16", "cpu_weight_prepack": False}, **settings)
    assert reference_llm.engine.runner.model.model.layers[0].mlp.experts.grouped_experts is None
    reference = reference_llm.generate(prompts, greedy(10, logprobs=1))
    for ours, theirs in zip(fused, reference):
        assert ours.token_ids == theirs.token_ids
        for step_ours, step_theirs in zip(ours.logprobs, theirs.logprobs):
            token = next(iter(step_theirs))
            assert abs(step_ours[token] - step_theirs[token]) < 0.05
