"""Triton grouped-GEMM mixture-of-experts against ``moe_ref``, and the expert-sorted row alignment it runs on."""

from __future__ import annotations

import inspect

import pytest
import torch

from kernels import TORCH_KERNELS, load_kernels
from kernels.moe_ref import fused_moe_ref
from kernels.triton_moe import BLOCK_M, align_rows_by_expert, fused_moe_triton
from tests.moe_checkpoints import moe_checkpoint  # noqa: F401 (a fixture)


def moe_inputs(num_tokens, hidden, intermediate, num_experts, top_k, device, dtype=torch.float32, skew=False):
    x = torch.randn(num_tokens, hidden, device=device)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, device=device) * hidden ** -0.5
    down = torch.randn(num_experts, hidden, intermediate, device=device) * intermediate ** -0.5
    logits = torch.randn(num_tokens, num_experts, device=device)
    if skew:  # most tokens on expert 1: its run spans several tiles, other experts get few or no rows
        logits[:, 1] += 4
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k)
    return x.to(dtype), gate_up.to(dtype), down.to(dtype), weights, ids


@pytest.mark.parametrize(
    "num_tokens, hidden, intermediate, num_experts, top_k, skew",
    [
        (1, 64, 32, 8, 2, False),  # one decode token
        (13, 64, 48, 8, 2, False),  # Mixtral-like, sizes not multiples of the tiles
        (40, 96, 24, 16, 4, True),  # Qwen3-MoE-like top-4, one expert over several tiles, some unused
        (7, 32, 80, 5, 1, False),  # top-1, intermediate over one K tile of the down GEMM
    ],
)
def test_fused_moe_matches_reference(device, num_tokens, hidden, intermediate, num_experts, top_k, skew):
    inputs = moe_inputs(num_tokens, hidden, intermediate, num_experts, top_k, device, skew=skew)
    if skew:
        assert (inputs[-1] == 1).sum() > 2 * BLOCK_M and (inputs[-1] == 0).sum() < BLOCK_M
    actual, expected = fused_moe_triton(*inputs), fused_moe_ref(*inputs)
    assert actual.shape == expected.shape == (num_tokens, hidden) and actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_moe_half_precision(device, dtype):
    x, gate_up, down, weights, ids = moe_inputs(9, 64, 32, 6, 2, device, dtype)
    actual, expected = fused_moe_triton(x, gate_up, down, weights, ids), fused_moe_ref(x, gate_up, down, weights, ids)
    assert actual.dtype == dtype
    torch.testing.assert_close(actual, expected, atol=3e-2, rtol=2e-2)


def test_rows_are_grouped_by_expert_in_whole_tiles(device):
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]], device=device)  # rows 0..7, expert 3 holds rows 0, 2, 5, 6
    padded_rows, tile_experts = align_rows_by_expert(ids, num_experts=5, block_m=BLOCK_M)
    tiles = padded_rows.view(-1, BLOCK_M).cpu()
    used = tile_experts.cpu().tolist()
    assert used[:4] == [0, 1, 2, 3] and set(used[4:]) == {-1}  # expert 4 has no rows: no tile
    real = [[row for row in tile if row < ids.numel()] for tile in tiles.tolist()]
    assert real[:4] == [[1, 4], [3], [7], [0, 2, 5, 6]]  # each expert's rows in token order
    assert all(not rows for rows in real[4:])


def test_empty_batch(device):
    x, gate_up, down, weights, ids = moe_inputs(0, 32, 16, 4, 2, device)
    assert fused_moe_triton(x, gate_up, down, weights, ids).shape == (0, 32)


def test_triton_set_uses_it_with_the_reference_signature():
    triton_kernels = load_kernels("triton", "cpu")
    assert triton_kernels.fused_moe is fused_moe_triton
    ours, ref = inspect.signature(fused_moe_triton), inspect.signature(TORCH_KERNELS.fused_moe)
    assert list(ours.parameters) == list(ref.parameters)


def test_moe_model_on_the_triton_set_matches_transformers(moe_checkpoint, hf_reference):
    """A Qwen3-MoE checkpoint (a dense layer among sparse ones) through every triton kernel: prefill, then a decode."""
    from pipeline.weights import load_model
    from tests.pipeline.test_models import PagedSequences, hf_logits, random_tokens

    path = moe_checkpoint("qwen3_moe")
    model, hf_config = load_model(path, torch.float32, "cpu")
    kernels = load_kernels("triton", "cpu")
    tokens = random_tokens(hf_config.vocab_size, 10, seed=2)
    paged = PagedSequences(model, num_seqs=1, max_len=len(tokens))
    with torch.inference_mode():
        logits = torch.cat([model.compute_logits(model(paged.step([part]), paged.kv_cache, kernels))
                            for part in (tokens[:9], tokens[9:])])
    torch.testing.assert_close(logits, hf_logits(hf_reference(path)[0], tokens), atol=1e-4, rtol=0)
