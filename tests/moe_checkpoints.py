"""Tiny mixture-of-experts checkpoints for the MoE tests (models, cluster): configs and a session cache."""

from __future__ import annotations

import pytest

from pipeline.builtin_model import build_checkpoint

# Several experts per token, GQA, dense layers among sparse ones (Qwen3-MoE), renormalised top-k both ways.
MOE_CONFIGS: dict[str, tuple[str, dict]] = {
    # layer 1 dense by mlp_only_layers; 8 experts, top-4 renormalised
    "qwen3_moe": ("qwen3_moe", dict(
        tokenizer_vocab_size=300, extra_vocab=3, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[1], initializer_range=0.08,
    )),
    # layer 0 dense by decoder_sparse_step 2; 10 experts, top-4 not renormalised, tied embeddings
    "qwen3_moe_unnormed": ("qwen3_moe", dict(
        tokenizer_vocab_size=300, extra_vocab=1, hidden_size=64, intermediate_size=80, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, num_experts=10, num_experts_per_tok=4,
        norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True, initializer_range=0.08,
    )),
    # every layer sparse; 8 experts, top-2
    "mixtral": ("mixtral", dict(
        tokenizer_vocab_size=300, extra_vocab=5, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        initializer_range=0.08,
    )),
}
# Which layers hold the MoE MLP, per config (transformers' rule, spelled out).
SPARSE_LAYERS = {"qwen3_moe": [True, False, True], "qwen3_moe_unnormed": [False, True], "mixtral": [True, True]}


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory):
    """``moe_checkpoint(name)`` -> path of the random-weight checkpoint ``MOE_CONFIGS[name]``, built once."""
    cache: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in cache:
            architecture, settings = MOE_CONFIGS[name]
            cache[name] = str(build_checkpoint(tmp_path_factory.mktemp(f"tiny-{name}"), architecture, **settings))
        return cache[name]

    return make
