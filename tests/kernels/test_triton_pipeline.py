"""The whole pipeline on the triton kernels (CPU interpreter): token-exact with transformers."""

from __future__ import annotations

import pytest

from pipeline import LLM, SamplingParams
from tests.conftest import assert_no_leaks, hf_greedy

pytest.importorskip("triton")


@pytest.mark.parametrize("arch", ["llama"])
def test_triton_backend_greedy_matches_transformers(arch, tiny_checkpoint, hf_reference):
    model, tokenizer = hf_reference(tiny_checkpoint(arch))
    prompts = [tokenizer(p)["input_ids"] for p in ("Hello there, how are you?", "The quick brown fox")]
    expected = [hf_greedy(model, p, 6) for p in prompts]
    # A small pool keeps the interpreter fast (it copies every argument's storage per launch);
    # page size 4 and 5-token chunks exercise multi-page contexts and chunked prefill.
    # fp32 pinned: on a GPU "auto" means bf16, and the reference is transformers in fp32
    llm = LLM(model=tiny_checkpoint(arch), kernel_backend="triton", max_batch_input_tokens=5,
              kv_cache={"page_size": 4, "num_blocks": 16}, model_config={"dtype": "float32"})
    assert llm.engine.kernels.name == "triton"
    free_at_start = llm.engine.kv_manager.num_free_blocks
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2))
    assert [o.token_ids for o in outputs] == expected
    assert_no_leaks(llm.engine.kv_manager, free_at_start)
