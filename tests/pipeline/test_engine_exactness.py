"""The engine against transformers' own generate() on the same weights: token for token, fp32, CPU."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ARCHITECTURES, assert_no_leaks, greedy, hf_greedy, hf_logprobs
from pipeline import LLM
from pipeline.config import ConfigError

NUM_NEW_TOKENS = 32
PROMPT_LENGTHS = [3, 17, 5, 29, 11, 8, 23, 1]


def make_prompts(vocab_size: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def references(tiny_checkpoint, hf_reference):
    """Greedy continuations by transformers for each architecture, computed once."""
    cache: dict[str, tuple[list[list[int]], list[list[int]]]] = {}

    def get(arch: str):
        if arch not in cache:
            model, _ = hf_reference(tiny_checkpoint(arch))
            prompts = make_prompts(model.config.vocab_size)
            cache[arch] = (prompts, [hf_greedy(model, p, NUM_NEW_TOKENS) for p in prompts])
        return cache[arch]

    return get


def generate_and_check(llm: LLM, prompts, expected, num_new_tokens: int = NUM_NEW_TOKENS) -> None:
    """``llm``'s greedy outputs are ``expected`` token for token, each to its length, and every block is back."""
    free_at_start = llm.engine.kv_manager.num_free_blocks
    outputs = llm.generate(prompts, greedy(num_new_tokens))
    for i, (out, want) in enumerate(zip(outputs, expected)):
        assert out.token_ids == want, f"prompt {i} (len {len(prompts[i])}) diverged"
        assert out.finish_reason == "length"
    assert_no_leaks(llm.engine.kv_manager, free_at_start)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_batch_matches_transformers(arch, tiny_checkpoint, references):
    prompts, expected = references(arch)
    llm = LLM(model=tiny_checkpoint(arch), kv_cache={"page_size": 16, "num_blocks": 128})
    generate_and_check(llm, prompts, expected)


def record_preemptions(llm: LLM) -> list[str]:
    """Wrap the scheduler's preemption so a test can assert it really happened."""
    preempted: list[str] = []
    original = llm.engine.scheduler._preempt

    def counting(seq, out):
        preempted.append(seq.request_id)
        original(seq, out)

    llm.engine.scheduler._preempt = counting
    return preempted


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tiny_pages_small_chunks_and_preemption(arch, tiny_checkpoint, references):
    """Page size 2 (sequences span up to 31 blocks), 7-token steps shared by several prompts (at
    most 3 tokens each while others wait), and a pool far too small for the whole batch: chunking
    and preemption by recompute must not change a single token."""
    prompts, expected = references(arch)
    llm = LLM(
        model=tiny_checkpoint(arch),
        max_batch_input_tokens=7,
        long_prefill_token_threshold=3,
        kv_cache={"page_size": 2, "num_blocks": 48, "enable_prefix_caching": False},
    )
    preempted = record_preemptions(llm)
    generate_and_check(llm, prompts, expected)
    assert preempted, "the pool was meant to be too small for the whole batch"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefix_cache_hits_stay_exact(arch, tiny_checkpoint, hf_reference):
    model, _ = hf_reference(tiny_checkpoint(arch))
    shared = make_prompts(model.config.vocab_size, [21], seed=3)[0]
    tails = make_prompts(model.config.vocab_size, [1, 6, 9, 4], seed=4)
    prompts = [shared + t for t in tails] + [shared]
    expected = [hf_greedy(model, p, 12) for p in prompts]
    llm = LLM(model=tiny_checkpoint(arch), kv_cache={"page_size": 4, "num_blocks": 128})
    free_at_start = llm.engine.kv_manager.num_free_blocks
    first = llm.generate(prompts[:1], greedy(12))
    assert first[0].token_ids == expected[0]
    assert llm.engine.num_prompt_tokens_computed == len(prompts[0])
    outs = llm.generate(prompts, greedy(12))  # every prompt now hits the cached 20-token prefix
    assert [o.token_ids for o in outs] == expected
    # only what the cache lacked ran through the model (the load report's tandem_worker_prompt_tokens_computed)
    assert llm.engine.num_prompt_tokens_computed == len(prompts[0]) + sum(len(p) - 20 for p in prompts)
    hits = [llm.engine.kv_manager.find_cached_prefix(p) for p in prompts]
    assert all(len(h) >= 5 for h in hits)
    assert_no_leaks(llm.engine.kv_manager, free_at_start)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logprobs_match_transformers_log_softmax(arch, tiny_checkpoint, hf_reference):
    model, _ = hf_reference(tiny_checkpoint(arch))
    prompts = make_prompts(model.config.vocab_size, [6, 13], seed=7)
    llm = LLM(model=tiny_checkpoint(arch), kv_cache={"page_size": 4, "num_blocks": 64})
    outs = llm.generate(prompts, greedy(8, logprobs=3))
    for prompt, out in zip(prompts, outs):
        reference = hf_logprobs(model, prompt + out.token_ids)  # [len, vocab]
        for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            row = reference[len(prompt) - 1 + step]
            assert token in entry and len(entry) in (3, 4)
            top3 = torch.topk(row, 3).indices.tolist()
            assert set(top3) <= set(entry)
            for token_id, logprob in entry.items():
                assert abs(logprob - row[token_id].item()) < 1e-4


def test_prompt_chunks_through_torch_flash_attention_stay_exact(monkeypatch, tiny_checkpoint, references):
    """As an AMX CPU routes bf16 prompt chunks (``kernels/cpu_paged_attention.py``): every chunk of 4 or more rows
    goes to torch's flash attention over its gathered pages, in fp32 here so that tokens can be compared, while
    decodes in the same steps stay on the native kernel. 7-token steps split prompts over cached prefixes."""
    from kernels import cpu_native
    from tests.paged_batches import route_prompts_to_flash

    if cpu_native.ops is None:
        pytest.skip("kernels._cpu_ops is not built: every sequence takes the reference")
    routed = route_prompts_to_flash(monkeypatch, (torch.float32,))
    prompts, expected = references("llama")
    llm = LLM(model=tiny_checkpoint("llama"), max_batch_input_tokens=7,
              kv_cache={"page_size": 4, "num_blocks": 128})
    generate_and_check(llm, prompts, expected)
    assert any(kv_len > q_len for q_len, kv_len in routed), "no chunk was routed over a cached prefix"


def test_chunked_prefill_disabled_matches_too(tiny_checkpoint, references):
    prompts, expected = references("qwen2")
    llm = LLM(model=tiny_checkpoint("qwen2"), enable_chunked_prefill=False, max_batch_input_tokens=64, max_length=64,
              kv_cache={"page_size": 8, "num_blocks": 128})
    generate_and_check(llm, prompts, expected)


def test_chunked_prefill_disabled_needs_a_step_that_holds_the_longest_prompt(tiny_checkpoint):
    """Else a prompt longer than one step would wait forever; the model's own limit counts when max_length is
    unset (it is checked where it is known: when the checkpoint is read)."""
    with pytest.raises(ConfigError, match=r"max_batch_input_tokens: must be >= max_length when enable_chunked_prefill "
                                          r"is false \(got 64 < \d+, the model's limit\)"):
        LLM(model=tiny_checkpoint("qwen2"), enable_chunked_prefill=False, max_batch_input_tokens=64)


@pytest.mark.parametrize("mode", ["plain", "overlap", "speculative"])
def test_a_chats_next_turn_computes_only_what_is_new_and_stays_exact(mode, tiny_checkpoint, hf_reference, drafts):
    """Each turn repeats the last one's prompt and answer: the worker that produced them holds the KV of
    all but the answer's last token (its last block only partly filled), so the next turn computes that
    token and the new message, nothing more, and its tokens stay transformers'."""
    path = tiny_checkpoint("llama")
    model, _ = hf_reference(path)
    extra = {"overlap": dict(enable_overlap_scheduler=True),
             "speculative": dict(draft_model={"model_path": drafts("llama", "small")},
                                 speculative={"num_speculative_tokens": 2})}.get(mode, {})
    llm = LLM(model=path, kv_cache={"page_size": 4, "num_blocks": 128}, **extra)
    free_at_start = llm.engine.kv_manager.num_free_blocks
    prompt: list[int] = []
    for turn, message in enumerate(make_prompts(model.config.vocab_size, [22, 6, 7], seed=5)):
        prompt = prompt + message
        computed_before = llm.engine.num_prompt_tokens_computed
        out = llm.generate([prompt], greedy(13))[0]
        assert out.token_ids == hf_greedy(model, prompt, 13), f"turn {turn + 1} diverged"
        computed = llm.engine.num_prompt_tokens_computed - computed_before
        if turn == 0:
            assert computed == len(prompt)
        elif mode == "speculative":  # the draft's KV may end a little earlier: never more than a block
            assert len(message) + 1 <= computed <= len(message) + 1 + 4
        else:  # everything but the last answer token was held, its partly filled last block included
            assert (len(prompt) - len(message) - 1) % 4, "the held tokens should end inside a block"
            assert computed == len(message) + 1
        prompt = prompt + out.token_ids
    assert_no_leaks(llm.engine.kv_manager, free_at_start)
