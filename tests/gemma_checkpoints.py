"""Tiny Gemma 3 checkpoints for the Gemma 3 tests (models, cluster): configs and a session cache."""

from __future__ import annotations

import pytest

from pipeline.builtin_model import build_checkpoint

# Local and global layers with windows shorter than the test prompts, GQA, every Gemma 3 switch set one way or the other.
GEMMA3_CONFIGS: dict[str, dict] = {
    # sliding_window_pattern 3: local, local, global, local, local; linearly scaled global RoPE; tied embeddings;
    # softcapped logits; an attention softcap transformers does not apply (so neither may Tandem)
    "gemma3": dict(
        tokenizer_vocab_size=300, extra_vocab=5, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8, sliding_window_pattern=3,
        query_pre_attn_scalar=24, rope_theta=100_000.0, rope_local_base_freq=5_000.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0}, final_logit_softcapping=3.0,
        attn_logit_softcapping=2.0, max_position_embeddings=512, initializer_range=0.08,
    ),
    # layer_types spelled out (global first), one kv head for four query heads, biased projections, untied
    # embeddings, no softcapping, window 6
    "gemma3_untied": dict(
        tokenizer_vocab_size=300, extra_vocab=2, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, sliding_window=6,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=24, attention_bias=True, tie_word_embeddings=False, max_position_embeddings=512,
        initializer_range=0.08,
    ),
}
# Which layers are local (sliding window), per config: transformers' reading of it, spelled out.
LOCAL_LAYERS = {"gemma3": [True, True, False, True, True], "gemma3_untied": [False, True, True, False]}


@pytest.fixture(scope="session")
def gemma3_checkpoint(tmp_path_factory):
    """``gemma3_checkpoint(name)`` -> path of the random-weight checkpoint ``GEMMA3_CONFIGS[name]``, built once."""
    cache: dict[str, str] = {}

    def make(name: str = "gemma3") -> str:
        if name not in cache:
            cache[name] = str(build_checkpoint(tmp_path_factory.mktemp(f"tiny-{name}"), "gemma3", **GEMMA3_CONFIGS[name]))
        return cache[name]

    return make
