"""gpt-oss on the triton kernel set (CPU interpreter): attention sinks on sliding and full layers through the
triton paged attention kernel, token-exact with transformers."""

from __future__ import annotations

from pipeline import LLM, SamplingParams
from tests.conftest import assert_no_leaks, hf_greedy
from tests.gpt_oss_checkpoints import gpt_oss_checkpoint  # noqa: F401 (a fixture)


def test_triton_set_greedy_matches_transformers(gpt_oss_checkpoint, hf_reference):
    path = gpt_oss_checkpoint("gpt_oss")
    model, tokenizer = hf_reference(path)
    prompts = [tokenizer(p)["input_ids"] for p in ("Hello there, how are you? I am fine, thank you.", "def main():")]
    assert len(prompts[0]) > model.config.sliding_window
    expected = [hf_greedy(model, p, 6) for p in prompts]
    # a small pool keeps the interpreter fast; 5-token chunks prefill over cached prefixes; fp32 as the reference
    llm = LLM(model=path, kernel_backend="triton", max_batch_input_tokens=5,
              kv_cache={"page_size": 4, "num_blocks": 24}, model_config={"dtype": "float32"})
    assert llm.engine.kernels.name == "triton"
    free_at_start = llm.engine.kv_manager.num_free_blocks
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected
    assert_no_leaks(llm.engine.kv_manager, free_at_start)
