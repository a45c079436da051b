"""The triton kernel set as a model runner sees it: same call signatures as the torch set, and a
prefill -> KV transfer -> decode run of one attention layer that agrees with the torch kernels."""

from __future__ import annotations

import inspect

import pytest
import torch

from kernels import TORCH_KERNELS, load_kernels
from kernels.norm_rope_ref import rope_cos_sin_cache
from kernels.triton_common import check_launchable
from kernels.triton_kv_store import _store_kv_kernel

KERNEL_FIELDS = ("store_kv", "paged_attention", "rms_norm", "apply_rotary", "pack_kv_blocks", "unpack_kv_blocks")


def test_triton_set_has_the_reference_signatures():
    triton_kernels = load_kernels("triton", "cpu")
    assert triton_kernels.name == "triton"
    for field in KERNEL_FIELDS:
        ours, ref = inspect.signature(getattr(triton_kernels, field)), inspect.signature(getattr(TORCH_KERNELS, field))
        assert [(p.name, p.default) for p in ours.parameters.values()] == \
            [(p.name, p.default) for p in ref.parameters.values()], field


def test_cpu_tensors_without_the_interpreter_fail_clearly():
    compiled_kernel = getattr(_store_kv_kernel, "fn", _store_kv_kernel)  # any non-interpreted callable
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        check_launchable(compiled_kernel, torch.zeros(1))


class TinyAttentionLayer:
    """norm -> qkv -> rotary -> store K/V -> paged attention, over a flat batch, on a given kernel set."""

    def __init__(self, hidden=64, num_q_heads=4, num_kv_heads=2, head_dim=32, device="cpu"):
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.norm_weight = torch.rand(hidden, device=device) + 0.5
        self.w_qkv = torch.randn(hidden, (num_q_heads + 2 * num_kv_heads) * head_dim, device=device) * hidden ** -0.5
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.cos_sin_cache = rope_cos_sin_cache(inv_freq, 256).to(device)

    def __call__(self, kernels, hidden, residual, kv_cache, positions, slot_mapping, cu_seqlens_q, context_lens,
                 block_tables):
        normed, residual = kernels.rms_norm(hidden, self.norm_weight, 1e-6, residual)
        qkv = normed @ self.w_qkv  # [num_tokens, (q + 2 kv heads) * head_dim]
        q_size, kv_size = self.num_q_heads * self.head_dim, self.num_kv_heads * self.head_dim
        query = qkv[:, :q_size].view(-1, self.num_q_heads, self.head_dim)
        key = qkv[:, q_size : q_size + kv_size].view(-1, self.num_kv_heads, self.head_dim)
        value = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        query, key = kernels.apply_rotary(query, key, positions, self.cos_sin_cache)
        kernels.store_kv(key, value, kv_cache[0, 0], kv_cache[0, 1], slot_mapping)
        out = kernels.paged_attention(query, kv_cache[0, 0], kv_cache[0, 1], cu_seqlens_q, context_lens,
                                      block_tables, self.head_dim ** -0.5)
        return out.reshape(out.shape[0], -1), residual


def run_disaggregated(kernels, layer, prompt_lens, num_decode_steps, page_size, device):
    """Prefill on one cache, pack and unpack the blocks into a decode cache, then decode there."""
    torch.manual_seed(1)
    hidden_size = layer.norm_weight.numel()
    num_blocks_per_seq = -(-(max(prompt_lens) + num_decode_steps) // page_size)
    num_seqs = len(prompt_lens)
    num_blocks = 2 * num_seqs * num_blocks_per_seq + 4
    prefill_cache = torch.zeros(1, 2, num_blocks, page_size, layer.num_kv_heads, layer.head_dim, device=device)
    decode_cache = torch.zeros(1, 2, num_blocks, page_size, layer.num_kv_heads, layer.head_dim, device=device)
    prefill_tables = torch.arange(num_seqs * num_blocks_per_seq, device=device).view(num_seqs, -1).flip(1).int()
    decode_tables = (torch.arange(num_seqs * num_blocks_per_seq, device=device).view(num_seqs, -1) * 2 + 3).int()

    def step(cache, tables, q_lens, ctx_lens):
        positions = torch.cat([torch.arange(c - q, c) for q, c in zip(q_lens, ctx_lens)]).to(device)
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), torch.tensor(q_lens)).to(device)
        slots = tables[seq_of_token, positions // page_size].long() * page_size + positions % page_size
        hidden = torch.randn(len(positions), hidden_size, device=device)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
        return layer(kernels, hidden, torch.randn_like(hidden), cache, positions, slots, cu, ctx, tables)

    outputs = [step(prefill_cache, prefill_tables, prompt_lens, prompt_lens)]
    for i in range(num_seqs):  # per-request transfer, as the KV connector does it
        buffer = kernels.pack_kv_blocks(prefill_cache, prefill_tables[i].long(), slice(0, 1))
        kernels.unpack_kv_blocks(buffer, decode_cache, decode_tables[i].long(), slice(0, 1))
    ctx_lens = list(prompt_lens)
    for _ in range(num_decode_steps):
        ctx_lens = [c + 1 for c in ctx_lens]
        outputs.append(step(decode_cache, decode_tables, [1] * num_seqs, ctx_lens))
    return outputs, decode_cache


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_transfer_decode_agrees_with_torch_kernels(device, page_size):
    layer = TinyAttentionLayer(device=device)
    triton_kernels = load_kernels("triton", device)
    expected, expected_cache = run_disaggregated(TORCH_KERNELS, layer, [7, 12], 3, page_size, device)
    actual, actual_cache = run_disaggregated(triton_kernels, layer, [7, 12], 3, page_size, device)
    torch.testing.assert_close(actual_cache, expected_cache, atol=1e-5, rtol=1e-5)
    for (out, residual), (want_out, want_residual) in zip(actual, expected):
        torch.testing.assert_close(out, want_out, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(residual, want_residual, atol=0, rtol=0)
