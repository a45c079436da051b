"""Tiny random-weight DeepSeek-V3 checkpoints for the DeepSeek-V3 tests (model, kernels, cluster): configs, a
session cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Both exercise several routed experts per token, shared experts, dense first layers and grouped routing
# (n_group > 1, topk_group < n_group); v_head_dim differs from the q/k head dim.
DEEPSEEK_CONFIGS: dict[str, dict] = {
    # q through the q LoRA, interleaved rope, default rope, renormalised top-k
    "deepseek_v3": dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
        num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True, initializer_range=0.08,
    ),
    # plain q_proj, rotate-half rope with yarn scaling (mscale in the softmax scale), top-k not renormalised
    "deepseek_v3_yarn": dict(
        hidden_size=64, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3, first_k_dense_replace=2,
        num_attention_heads=2, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=12, num_experts_per_tok=4, n_group=3, topk_group=2, n_shared_experts=1,
        routed_scaling_factor=1.5, norm_topk_prob=False, rope_interleave=False, initializer_range=0.08,
        max_position_embeddings=256, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
            beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.8),
    ),
}


def build_deepseek_checkpoint(path: str | os.PathLike, name: str, tokenizer_vocab_size: int = 300,
                              extra_vocab: int = 3, seed: int = 0) -> Path:
    """Write the random-weight checkpoint ``DEEPSEEK_CONFIGS[name]`` to ``path``, with the routers' score
    correction biases and the latent norms' weights random too (transformers starts them at 0 and 1)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from pipeline.builtin_model import build_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(tokenizer_vocab_size)
    config = DeepseekV3Config(vocab_size=len(tokenizer) + extra_vocab, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=None, **DEEPSEEK_CONFIGS[name])
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.05)
        for param_name, param in model.named_parameters():
            if param_name.endswith("layernorm.weight"):
                param.normal_(1.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def deepseek_checkpoint(tmp_path_factory):
    """``deepseek_checkpoint(name)`` -> path of the checkpoint ``DEEPSEEK_CONFIGS[name]``, built once."""
    cache: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in cache:
            cache[name] = str(build_deepseek_checkpoint(tmp_path_factory.mktemp(f"tiny-{name}"), name))
        return cache[name]

    return make
