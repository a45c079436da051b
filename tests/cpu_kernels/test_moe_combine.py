"""The native MoE combine (``kernels/cpu_moe.combine_grouped_rows_cpu``, ``moe_combine_rows`` in
``kernels/native/elementwise_isa.h``) against its torch reference, ``kernels/moe_ref.combine_grouped_rows``, on
every instruction set this CPU runs and on one and two threads: bit for bit in fp32 and bf16 (same order of adds,
same rounding), whatever the routing; and a whole MoE layer through the CPU set against the torch set."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_native, load_kernels
from kernels.cpu_moe import combine_grouped_rows_cpu
from kernels.moe_ref import combine_grouped_rows, sort_rows_by_expert

pytestmark = pytest.mark.skipif(cpu_native.ops is None, reason="kernels._cpu_ops is not built")


def routed_rows(num_tokens: int, top_k: int, num_experts: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    """Random routing (distinct experts per token), its rows' outputs in expert order, and routing weights."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    topk_ids = scores.topk(top_k, dim=-1).indices  # [num_tokens, top_k], not sorted by expert within a token
    topk_weights = torch.rand(num_tokens, top_k, generator=generator).to(dtype)
    order, _ = sort_rows_by_expert(topk_ids, num_experts)
    grouped_out = (torch.randn(num_tokens * top_k, hidden, generator=generator) * 3).to(dtype)
    return grouped_out, order, topk_weights


# top-1 to top-8 of 4 to 64 experts, hidden sizes off every vector width (7, 24, 100) and model-like ones
CASES = [(1, 1, 4, 16), (5, 2, 4, 7), (17, 8, 32, 768), (48, 8, 32, 24), (130, 4, 64, 100), (3, 6, 8, 2048)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_tokens,top_k,num_experts,hidden", CASES)
def test_native_combine_equals_the_reference_bit_for_bit(isa, threads, dtype, num_tokens, top_k, num_experts,
                                                         hidden):
    grouped_out, order, topk_weights = routed_rows(num_tokens, top_k, num_experts, hidden, dtype)
    expected = combine_grouped_rows(grouped_out, order, topk_weights, dtype)
    got = combine_grouped_rows_cpu(grouped_out, order, topk_weights, dtype)
    assert got.dtype == dtype and got.shape == (num_tokens, hidden)
    assert torch.equal(got, expected)


def test_strided_rows_and_unsupported_inputs_fall_back_or_match():
    grouped_out, order, topk_weights = routed_rows(40, 8, 32, 64, torch.float32, seed=1)
    wide = torch.zeros(grouped_out.shape[0], 96)
    wide[:, 16:80] = grouped_out
    strided = wide[:, 16:80]  # rows with a stride past their width
    assert torch.equal(combine_grouped_rows_cpu(strided, order, topk_weights, torch.float32),
                       combine_grouped_rows(grouped_out, order, topk_weights, torch.float32))
    as_double = grouped_out.double()  # no native body: the reference runs
    assert torch.equal(combine_grouped_rows_cpu(as_double, order, topk_weights, torch.float64),
                       combine_grouped_rows(as_double, order, topk_weights, torch.float64))


def test_bf16_rows_with_fp32_weights_sum_like_the_reference():
    grouped_out, order, topk_weights = routed_rows(64, 8, 32, 768, torch.bfloat16, seed=2)
    fp32_weights = torch.rand(topk_weights.shape, generator=torch.Generator().manual_seed(3))
    assert torch.equal(combine_grouped_rows_cpu(grouped_out, order, fp32_weights, torch.bfloat16),
                       combine_grouped_rows(grouped_out, order, fp32_weights, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_moe_layer_through_the_cpu_set_equals_the_torch_set(dtype):
    """The CPU set's combine in a real ``experts_over_grouped_rows`` call: the same output as the torch set's."""
    from kernels.moe_ref import experts_over_grouped_rows

    generator = torch.Generator().manual_seed(4)
    num_tokens, top_k, num_experts, hidden, inter = 33, 4, 8, 64, 32
    hidden_states = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=generator) / 8).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=generator) / 6).to(dtype)
    topk_weights, topk_ids = torch.rand(num_tokens, num_experts, generator=generator).softmax(-1).topk(top_k, -1)
    topk_weights = topk_weights.to(dtype)

    def expert(index, rows):
        gate, up = torch.nn.functional.linear(rows, gate_up[index]).chunk(2, dim=-1)
        return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down[index])

    outputs = [experts_over_grouped_rows(hidden_states, topk_weights, topk_ids, num_experts, expert,
                                         combine=load_kernels(backend).combine_grouped_rows)
               for backend in ("torch", "cpu")]
    assert load_kernels("cpu").combine_grouped_rows is combine_grouped_rows_cpu
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("combine", [combine_grouped_rows, combine_grouped_rows_cpu], ids=["reference", "native"])
def test_the_inputs_are_not_written(combine):
    """fp32 rows are the caller's (the reference once scaled them in place: ``.to`` of an fp32 tensor is itself)."""
    grouped_out, order, topk_weights = routed_rows(20, 4, 8, 32, torch.float32, seed=5)
    before = grouped_out.clone(), order.clone(), topk_weights.clone()
    combine(grouped_out, order, topk_weights, torch.float32)
    for tensor, kept in zip((grouped_out, order, topk_weights), before):
        assert torch.equal(tensor, kept)
