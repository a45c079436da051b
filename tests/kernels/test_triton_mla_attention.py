"""Triton latent attention (MLA, absorbed) against ``mla_attention_ref``: prefill over cached latent prefixes,
decode, mixed batches, head counts that do not fill a tile, latent and rope widths that are not powers of two."""

from __future__ import annotations

import pytest
import torch

from kernels.mla_attention_ref import mla_attention_ref, store_latent_ref
from kernels.triton_mla_attention import mla_attention_triton
from tests.deepseek_checkpoints import deepseek_checkpoint  # noqa: F401 (a fixture)
from tests.paged_batches import make_batch


def check(q_lens, context_lens, *, num_heads, kv_lora_rank, rope_dim, page_size, dtype=torch.float32, device="cpu",
          atol=2e-5, rtol=1e-4):
    query, latent_cache, _, cu_seqlens_q, context_lens_t, block_tables = make_batch(
        q_lens, context_lens, num_q_heads=num_heads, num_kv_heads=1, head_dim=kv_lora_rank + rope_dim,
        page_size=page_size, dtype=dtype, device=device)
    scale = 0.3
    expected = mla_attention_ref(query.float(), latent_cache.float(), cu_seqlens_q, context_lens_t, block_tables,
                                 scale, kv_lora_rank)
    actual = mla_attention_triton(query, latent_cache, cu_seqlens_q, context_lens_t, block_tables, scale, kv_lora_rank)
    assert actual.shape == (sum(q_lens), num_heads, kv_lora_rank) and actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected, atol=atol, rtol=rtol)


# (q_lens, context_lens, num_heads, kv_lora_rank, rope_dim, page_size)
CASES = [
    pytest.param([5, 17], [5, 17], 4, 16, 8, 4, id="fresh-prefill-p4"),
    pytest.param([3, 9], [40, 21], 2, 32, 16, 16, id="cached-prefix-p16"),
    pytest.param([1, 1, 1], [1, 33, 70], 4, 16, 8, 1, id="decode-p1"),
    pytest.param([1, 6, 1], [20, 30, 65], 20, 24, 8, 32, id="mixed-20-heads-two-tiles-p32"),
    pytest.param([1, 1], [150, 7], 16, 48, 24, 4, id="decode-many-pages-r48-e24"),
]


@pytest.mark.parametrize("q_lens, context_lens, num_heads, kv_lora_rank, rope_dim, page_size", CASES)
def test_matches_reference(device, q_lens, context_lens, num_heads, kv_lora_rank, rope_dim, page_size):
    check(q_lens, context_lens, num_heads=num_heads, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
          page_size=page_size, device=device)


def test_bf16_matches_reference_within_bf16(device):
    check([2, 1], [19, 44], num_heads=8, kv_lora_rank=32, rope_dim=16, page_size=16, dtype=torch.bfloat16,
          device=device, atol=2e-2, rtol=2e-2)


def test_reference_is_expanded_attention():
    """The absorbed reference equals attention with per-head keys [c W_uk^T, k_rope] and values c W_uv^T."""
    generator = torch.Generator().manual_seed(1)
    num_heads, rank, rope, nope, v_dim, length, page_size = 3, 12, 4, 5, 6, 9, 4
    latent = torch.randn(length, rank + rope, generator=generator)
    w_uk = torch.randn(num_heads, nope, rank, generator=generator)
    w_uv = torch.randn(num_heads, v_dim, rank, generator=generator)
    q_nope = torch.randn(length, num_heads, nope, generator=generator)
    q_rope = torch.randn(length, num_heads, rope, generator=generator)
    cache = torch.zeros(3, page_size, 1, rank + rope)
    store_latent_ref(latent, cache, torch.tensor([8 + i if i < 4 else i - 4 for i in range(length)]))
    block_tables = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    query = torch.cat((torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rope), dim=-1)
    out = mla_attention_ref(query, cache, torch.tensor([0, length], dtype=torch.int32),
                            torch.tensor([length], dtype=torch.int32), block_tables, 0.5, rank)
    got = torch.einsum("thr,hvr->thv", out, w_uv)

    keys = torch.cat((torch.einsum("sr,hnr->hsn", latent[:, :rank], w_uk),
                      latent[None, :, rank:].expand(num_heads, -1, -1)), dim=-1)  # [heads, length, nope + rope]
    values = torch.einsum("sr,hvr->hsv", latent[:, :rank], w_uv)
    scores = torch.einsum("thd,hsd->hts", torch.cat((q_nope, q_rope), dim=-1), keys) * 0.5
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hts,hsv->thv", scores.softmax(-1), values)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_deepseek_v3_on_the_triton_set_matches_transformers(deepseek_checkpoint, hf_reference):
    """The whole DeepSeek-V3 pipeline on the triton kernels (latent attention, grouped experts, rope, norms) under
    the interpreter: chunked prefill over a paged latent cache, then decodes, token-exact with transformers' fp32."""
    from pipeline import LLM, SamplingParams
    from tests.conftest import assert_no_leaks, hf_greedy

    path = deepseek_checkpoint("deepseek_v3")
    model, tokenizer = hf_reference(path)
    prompts = [tokenizer(p)["input_ids"] for p in ("Hello there, how are you?", "The quick brown fox")]
    llm = LLM(model=path, kernel_backend="triton", max_batch_input_tokens=5,
              kv_cache={"page_size": 4, "num_blocks": 16}, model_config={"dtype": "float32"})
    assert llm.engine.kernels.mla_attention is mla_attention_triton
    free_at_start = llm.engine.kv_manager.num_free_blocks
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == [hf_greedy(model, p, 6) for p in prompts]
    assert_no_leaks(llm.engine.kv_manager, free_at_start)


@pytest.mark.parametrize("layers", [slice(None), slice(1, 2)], ids=["all", "layer1"])
def test_latent_blocks_pack_and_unpack_like_the_reference(device, layers):
    """A latent cache has one page per layer and block ([layers, 1, ...]): the transfer kernels move just those."""
    from kernels.kv_pack_ref import pack_kv_blocks_ref
    from kernels.triton_kv_pack import pack_kv_blocks_triton, unpack_kv_blocks_triton

    source = torch.randn(3, 1, 9, 4, 1, 24, device=device)  # [layers, 1, blocks, page_size, 1, latent_dim]
    block_ids = torch.tensor([7, 0, 3], device=device)
    buffer = pack_kv_blocks_triton(source, block_ids, layers)
    assert torch.equal(buffer, pack_kv_blocks_ref(source, block_ids, layers)) and buffer.shape[1] == 1
    target = torch.zeros(3, 1, 5, 4, 1, 24, device=device)
    unpack_kv_blocks_triton(buffer, target, torch.tensor([4, 1, 2], device=device), layers)
    assert torch.equal(target[layers][:, :, [4, 1, 2]], source[layers][:, :, [7, 0, 3]])
    assert torch.count_nonzero(target[layers][:, :, [0, 3]]) == 0
