"""A config key the family's transformers code does not read changes nothing in Tandem either: a Llama config
carrying ``sliding_window`` still attends to the whole context, a Mistral one with ``attention_bias`` loads
without biases (its checkpoint has none), a Qwen2 one with ``mlp_bias`` likewise. Token for token against
transformers' forward, fp32. The reference is the forward over the whole sequence at each step, not ``generate``:
transformers' cache reads ``sliding_window`` from any config and keeps only that many keys during generation (a
Llama model then attends to the window while decoding and to everything in its prompt), and its ``min_new_tokens``
masks EOS where Tandem's ``ignore_eos`` does not."""

from __future__ import annotations

import pytest
import torch

from pipeline import LLM
from pipeline.builtin_model import build_checkpoint
from tests.conftest import TINY_CONFIGS
from tests.pipeline.test_engine_exactness import generate_and_check, make_prompts

CASES = {
    "llama-sliding_window": ("llama", {"sliding_window": 8}),
    "mistral-attention_bias": ("mistral", {"attention_bias": True}),
    "qwen2-mlp_bias": ("qwen2", {"mlp_bias": True}),
    "qwen2-attention_bias": ("qwen2", {"attention_bias": True}),
}


@pytest.mark.parametrize("case", CASES)
def test_a_key_transformers_ignores_is_ignored(case, tmp_path, hf_reference):
    arch, extra = CASES[case]
    path = build_checkpoint(tmp_path / case, arch, **{**TINY_CONFIGS[arch], **extra})
    model, _ = hf_reference(str(path))
    assert all(getattr(model.config, key) == value for key, value in extra.items())  # the key is in the config
    prompts = make_prompts(model.config.vocab_size, [30, 3, 19], seed=2)  # longer than the ignored window
    expected = [forward_greedy(model, p, 12) for p in prompts]
    generate_and_check(LLM(model=str(path), kv_cache={"page_size": 4, "num_blocks": 64}), prompts, expected, 12)


def forward_greedy(model, prompt: list[int], num_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers' forward over the whole sequence at each step (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
