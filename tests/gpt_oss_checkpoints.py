"""Tiny gpt-oss checkpoints for the gpt-oss tests (models, cluster): configs and a session cache."""

from __future__ import annotations

import pytest

from pipeline.builtin_model import build_checkpoint

# yarn RoPE as the released models set it, over a shorter original context so positions past it are scaled
YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 10_000.0}

# Several experts per token, GQA, windows shorter than the test prompts, sinks and expert biases non-zero
# (build_checkpoint draws them), a SwiGLU limit the activations cross (so the clamps act).
GPT_OSS_CONFIGS: dict[str, dict] = {
    # layer_types by default: sliding, full, sliding; 8 experts, top-4; two query heads per kv head
    "gpt_oss": dict(
        tokenizer_vocab_size=300, extra_vocab=3, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=4,
        sliding_window=8, swiglu_limit=0.5, rope_parameters=YARN, max_position_embeddings=512,
        initializer_range=0.08,
    ),
    # layer_types spelled out (full first), one kv head for four query heads, 6 experts, top-2, window 5
    "gpt_oss_gqa4": dict(
        tokenizer_vocab_size=300, extra_vocab=1, hidden_size=48, intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=12, num_local_experts=6, num_experts_per_tok=2,
        sliding_window=5, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        swiglu_limit=0.4, swiglu_alpha=1.5, rope_parameters=YARN, max_position_embeddings=512,
        initializer_range=0.08,
    ),
}
# Which layers are sliding window, per config: transformers' reading of it, spelled out.
SLIDING_LAYERS = {"gpt_oss": [True, False, True], "gpt_oss_gqa4": [False, True, True]}


@pytest.fixture(scope="session")
def gpt_oss_checkpoint(tmp_path_factory):
    """``gpt_oss_checkpoint(name)`` -> path of the random-weight checkpoint ``GPT_OSS_CONFIGS[name]``, built once."""
    cache: dict[str, str] = {}

    def make(name: str = "gpt_oss") -> str:
        if name not in cache:
            cache[name] = str(build_checkpoint(tmp_path_factory.mktemp(f"tiny-{name}"), "gpt_oss",
                                               **GPT_OSS_CONFIGS[name]))
        return cache[name]

    return make
