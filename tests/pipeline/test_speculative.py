"""Speculative decoding in the engine: greedy outputs token-identical to transformers and to the engine
without speculation, whatever the draft (the target itself, a small independent model, one that is
always wrong), through chunked prefill and preemption; seeded sampling repeatable; no block leaks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeline import LLM, SamplingParams
from pipeline.builtin_model import build_checkpoint
from pipeline.checkpoint_errors import CheckpointError
from pipeline.config import ConfigError
from tests.chi_square import assert_same_distribution
from tests.conftest import ARCHITECTURES, TINY_CONFIGS, assert_no_leaks, greedy
from tests.pipeline.test_engine_exactness import NUM_NEW_TOKENS, make_prompts, record_preemptions
from tests.pipeline.test_engine_exactness import references  # noqa: F401 (a fixture: transformers' greedy outputs)

K = 3


def speculative_llm(path: str, draft: str | None, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache", {"page_size": 4, "num_blocks": 256})
    return LLM(model=path, draft_model={"model_path": draft}, speculative={"num_speculative_tokens": K}, **kwargs)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("kind", ["self", "small", "wrong"])
def test_greedy_matches_transformers_with_chunks_and_preemption(arch, kind, tiny_checkpoint, drafts, references):
    """Page size 2, 7-token steps shared by several prompts, a pool too small for the batch."""
    prompts, expected = references(arch)
    llm = speculative_llm(tiny_checkpoint(arch), drafts(arch, kind), max_batch_input_tokens=11,
                          long_prefill_token_threshold=3,
                          kv_cache={"page_size": 2, "num_blocks": 64, "enable_prefix_caching": False})
    preempted = record_preemptions(llm)
    free_at_start = llm.engine.kv_manager.num_free_blocks
    outputs = llm.generate(prompts, greedy(NUM_NEW_TOKENS))
    assert [o.token_ids for o in outputs] == expected
    assert_no_leaks(llm.engine.kv_manager, free_at_start)
    assert preempted, "the pool was meant to be too small for the whole batch"
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0
    if kind == "self":
        assert stats.acceptance_rate == 1.0
    if kind == "wrong":
        zeros = sum(out.count(0) for out in expected)
        assert stats.num_accepted_tokens <= zeros  # it only ever proposes token 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_matches_without_speculation_and_prefix_hits(arch, tiny_checkpoint, drafts, hf_reference):
    model, _ = hf_reference(tiny_checkpoint(arch))
    shared = make_prompts(model.config.vocab_size, [21], seed=3)[0]
    prompts = [shared + t for t in make_prompts(model.config.vocab_size, [1, 6, 9, 4], seed=4)] + [shared]
    plain = LLM(model=tiny_checkpoint(arch), kv_cache={"page_size": 4, "num_blocks": 256})
    expected = [o.token_ids for o in plain.generate(prompts, greedy(20))]
    llm = speculative_llm(tiny_checkpoint(arch), drafts(arch, "truncated"))
    free_at_start = llm.engine.kv_manager.num_free_blocks
    llm.generate(prompts[:1], greedy(20))
    outputs = llm.generate(prompts, greedy(20))  # every prompt hits the cached prefix
    assert [o.token_ids for o in outputs] == expected
    assert all(len(llm.engine.kv_manager.find_cached_prefix(p)) >= 5 for p in prompts)
    assert_no_leaks(llm.engine.kv_manager, free_at_start)
    # a request that ends at its first token (a classifier's max_tokens 1) still leaves its prompt cached
    once = make_prompts(model.config.vocab_size, [24], seed=5)[0]
    assert llm.generate([once], greedy(1))[0].token_ids == plain.generate([once], greedy(1))[0].token_ids
    assert len(llm.engine.kv_manager.find_cached_prefix(once)) == (len(once) - 1) // 4  # all but the last token


def test_logprobs_penalties_and_stops_behave_as_without_speculation(tiny_checkpoint, drafts):
    """Every processor sees the drafts as emitted tokens: penalties, bias, bad words, min_tokens, stop ids,
    stop strings and max_tokens give the same tokens, and logprobs agree closely."""
    path = tiny_checkpoint("llama")
    prompts = make_prompts(300, [5, 12, 9, 3], seed=11)
    plain = LLM(model=path, kv_cache={"page_size": 4, "num_blocks": 256})
    llm = speculative_llm(path, drafts("llama", "truncated"))
    reference = plain.generate(prompts[:1], greedy(24))[0].token_ids
    cases = [
        greedy(24, logprobs=3),
        greedy(24, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3),
        greedy(24, logit_bias={reference[2]: -100.0, reference[5]: 5.0}),
        greedy(24, stop_token_ids=[reference[7]]),
        SamplingParams(max_tokens=24, temperature=0.0, min_tokens=10, stop_token_ids=[reference[3]]),
        greedy(17, bad_words=[plain.engine.tokenizer.decode(reference[4:6])]),
        greedy(24, stop=[plain.engine.tokenizer.decode(reference[9:11])]),
    ]
    for params in cases:
        want = plain.generate(prompts, params)
        got = llm.generate(prompts, params)
        for w, g in zip(want, got):
            assert g.token_ids == w.token_ids and g.text == w.text, params
            assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason), params
            for entry_w, entry_g in zip(w.logprobs or [], g.logprobs or []):
                assert entry_w.keys() == entry_g.keys()
                assert all(abs(entry_w[t] - entry_g[t]) < 1e-4 for t in entry_w)
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_total_blocks


def test_seeded_sampling_is_repeatable_alone_and_batched(tiny_checkpoint, drafts):
    path = tiny_checkpoint("qwen2")
    prompts = make_prompts(300, [7, 4, 15], seed=5)
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    llm = speculative_llm(path, drafts("qwen2", "small"))
    alone = llm.generate(prompts[:1], seeded)[0].token_ids
    again = llm.generate(prompts[:1], seeded)[0].token_ids
    batched = llm.generate(prompts, [seeded, SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True),
                                     greedy(20)])[0].token_ids
    assert alone == again == batched
    assert llm.engine.speculator.stats.num_draft_tokens > 0


@pytest.mark.parametrize("kind", ["small", "self"])
def test_seeded_sampling_emits_the_tokens_of_the_run_without_a_draft(tiny_checkpoint, drafts, kind):
    """However the prompt is chunked (a step budget of 512 or 16 moves where each speculation window begins) and
    whatever it is batched with, a seeded request emits what it emits without speculation: each position's token
    is the target's own draw there (an audit saw the first token change with the step budget)."""
    path = tiny_checkpoint("llama")
    prompts = make_prompts(300, [17, 3, 40], seed=6)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, seed=81, ignore_eos=True)
    plain = [o.token_ids for o in LLM(model=path, kv_cache={"page_size": 4, "num_blocks": 256}).generate(
        prompts, seeded)]
    for budget in (512, 16):
        llm = speculative_llm(path, drafts("llama", kind), max_batch_input_tokens=budget,
                              kv_cache={"page_size": 4, "num_blocks": 256})
        assert [llm.generate([p], seeded)[0].token_ids for p in prompts] == plain, budget
        assert [o.token_ids for o in llm.generate(prompts, seeded)] == plain, budget
        assert llm.engine.speculator.stats.num_accepted_tokens > 0


def test_abort_mid_speculation_frees_every_block(tiny_checkpoint, drafts):
    llm = speculative_llm(tiny_checkpoint("mistral"), drafts("mistral", "small"))
    engine = llm.engine
    free_at_start = engine.kv_manager.num_free_blocks
    for i, prompt in enumerate(make_prompts(300, [9, 30, 4], seed=2)):
        engine.add_request(f"r{i}", prompt, greedy(40))
    for _ in range(6):
        engine.step()
    assert engine.speculator.stats.num_drafts > 0
    for i in range(3):
        assert engine.abort_request(f"r{i}")
    assert_no_leaks(engine.kv_manager, free_at_start)
    assert not engine.has_unfinished_requests()


def test_draft_with_another_tokenizer_is_refused(tiny_checkpoint, tmp_path):
    other = build_checkpoint(tmp_path / "other", "llama", tokenizer_vocab_size=280, **{
        k: v for k, v in TINY_CONFIGS["llama"].items() if k != "tokenizer_vocab_size"})
    with pytest.raises(CheckpointError, match="does not share the target's tokenizer"):
        speculative_llm(tiny_checkpoint("llama"), str(other))
    with pytest.raises(CheckpointError, match="draft_model.model_path"):
        speculative_llm(tiny_checkpoint("llama"), str(tmp_path / "missing"))


def test_a_draft_shorter_than_the_targets_context_is_refused_until_max_length_fits(tiny_checkpoint, tmp_path):
    """The draft drafts at every position the target serves: one whose rotary tables end sooner is refused, by the
    engine and by the launchers' check before any process starts (it used to fail a step past its end, or read past
    its table on the native kernels); with max_length within it, it speculates and gives the plain engine's tokens."""
    from deploy.checkpoint_check import check_checkpoints
    from pipeline.config import PipelineConfig

    target = tiny_checkpoint("llama")
    draft = build_checkpoint(tmp_path / "short", "llama", seed=2, **{
        **TINY_CONFIGS["llama"], "num_hidden_layers": 1, "max_position_embeddings": 48})
    refusal = r"short covers 48 positions \(its max_position_embeddings\) but the target serves up to 2048"
    with pytest.raises(ConfigError, match=refusal):
        speculative_llm(target, str(draft))
    overrides = {"model": {"model_path": target}, "draft_model": {"model_path": str(draft)},
                 "speculative": {"num_speculative_tokens": K}}
    with pytest.raises(ConfigError, match=refusal):
        check_checkpoints(PipelineConfig.load(overrides=overrides))
    check_checkpoints(PipelineConfig.load(overrides={**overrides, "max_length": 48}))

    prompts = make_prompts(300, [40, 12], seed=6)
    plain = LLM(model=target, max_length=48, kv_cache={"page_size": 4, "num_blocks": 256})
    llm = speculative_llm(target, str(draft), max_length=48)
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)  # up to the last position
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(prompts, params)]
    assert [len(p) + len(o.token_ids) for p, o in zip(prompts, outputs)] == [48, 48]
    assert llm.engine.speculator.stats.num_draft_tokens > 0


def test_config_names_and_conflicts():
    with pytest.raises(ConfigError, match="enable_overlap_scheduler"):
        LLM(speculative={"num_speculative_tokens": 2}, enable_overlap_scheduler=True)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        LLM(speculative={"num_speculative_tokens": -1})


def test_draft_with_another_kv_layout_runs_colocated_and_is_refused_for_pd(tiny_checkpoint, tmp_path, references):
    """A draft whose KV per layer differs (here head_dim 8 vs 16) keeps a cache tensor of its own, which a
    colocated worker can use; a P/D worker must ship it with the target's KV, so it says why it cannot."""
    from pipeline.config import PipelineConfig
    from pipeline.engine import LLMEngine

    draft = build_checkpoint(tmp_path / "narrow", "llama", seed=2, **{
        **TINY_CONFIGS["llama"], "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "num_hidden_layers": 1})
    prompts, expected = references("llama")
    llm = speculative_llm(tiny_checkpoint("llama"), str(draft))
    assert llm.engine.draft_kv_cache.data_ptr() != llm.engine.kv_cache.data_ptr()
    assert [o.token_ids for o in llm.generate(prompts, greedy(NUM_NEW_TOKENS))] == expected
    for role in ("PrefillOnly", "DecodeOnly"):
        config = PipelineConfig.load(overrides={
            "pipeline_role": role, "model": {"model_path": tiny_checkpoint("llama")},
            "draft_model": {"model_path": str(draft)}, "speculative": {"num_speculative_tokens": 2},
            "kv_cache": {"num_blocks": 32}})
        with pytest.raises(ConfigError, match="same KV layout per layer"):
            LLMEngine(config)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_structured_output_speculates_within_the_grammar(backend, tiny_checkpoint, drafts):
    """Constrained requests speculate too: drafts walk the grammar (matchers rolled back after), verify rows
    carry the mask after their drafts, and the output is the one without speculation, valid to the schema."""
    import json

    import jsonschema

    from pipeline.protocol.requests import StructuredOutput

    path = tiny_checkpoint("llama")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]},
                                                        "maxItems": 3},
                                               "ok": {"type": "boolean"}},
              "required": ["name", "tags", "ok"], "additionalProperties": False}
    constraint = StructuredOutput(kind="json", value=json.dumps(schema), backend=backend)
    greedy_json = SamplingParams(max_tokens=60, temperature=0.0, structured_output=constraint)
    sampled_json = SamplingParams(max_tokens=60, temperature=0.8, seed=3, structured_output=constraint)
    prompts = make_prompts(300, [6, 9, 4], seed=8)
    params = [greedy_json, sampled_json, greedy(30)]
    plain = LLM(model=path, kv_cache={"page_size": 4, "num_blocks": 256})
    want = plain.generate(prompts, params)
    for kind in ("self", "truncated"):
        llm = speculative_llm(path, drafts("llama", kind))
        got = llm.generate(prompts, params)
        assert [o.token_ids for o in got[::2]] == [o.token_ids for o in want[::2]]  # greedy rows: identical
        for out in got[:2]:
            jsonschema.validate(json.loads(out.text), schema)
        stats = llm.engine.speculator.stats
        assert stats.num_drafts > 0 and (kind != "self" or stats.acceptance_rate > 0.5)
        assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_total_blocks
        drafts_before = stats.num_draft_tokens
        assert llm.generate(prompts[:1], greedy_json)[0].token_ids == want[0].token_ids
        assert stats.num_draft_tokens > drafts_before  # the constrained request alone speculated


def test_sampled_tokens_are_distributed_as_without_speculation(tiny_checkpoint, drafts):
    """End to end through draft, verify rows and per-row processing: the three sampled tokens of one
    prompt (temperature 1.5, top-k 2, a strong presence penalty) have the same joint distribution with an
    independent draft as without speculation (two-sample chi-square at the 0.001 level)."""
    from collections import Counter

    path = tiny_checkpoint("qwen2")
    prompt = make_prompts(300, [5], seed=21)[0]
    params = SamplingParams(max_tokens=3, temperature=1.5, top_k=3, presence_penalty=1.0, frequency_penalty=1.0, ignore_eos=True)
    counts = []
    for llm in (LLM(model=path, max_batch_size=256, kv_cache={"page_size": 4, "num_blocks": 1024}),
                speculative_llm(path, drafts("qwen2", "self"), max_batch_size=256,
                                kv_cache={"page_size": 4, "num_blocks": 1024})):
        counts.append(Counter(tuple(o.token_ids) for o in llm.generate([prompt] * 1500, params)))
    stats = llm.engine.speculator.stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    cells = [c for c in set(counts[0]) | set(counts[1]) if counts[0][c] + counts[1][c] >= 10]
    assert len(cells) >= 5
    assert_same_distribution(*(torch.tensor([float(side[c]) for c in cells]) for side in counts))


def pd_engines(arch: str, path: str, draft: str | None, decode_blocks: int):
    from pipeline.config import PipelineConfig
    from pipeline.engine import LLMEngine

    def engine(role: str, num_blocks: int, budget: int) -> LLMEngine:
        return LLMEngine(PipelineConfig.load(overrides={
            "pipeline_role": role, "model": {"model_path": path}, "draft_model": {"model_path": draft},
            "speculative": {"num_speculative_tokens": K}, "max_batch_input_tokens": budget,
            "long_prefill_token_threshold": 4,
            "kv_cache": {"page_size": 2, "num_blocks": num_blocks, "enable_prefix_caching": False}}))

    return engine("PrefillOnly", 256, 9), engine("DecodeOnly", decode_blocks, 11)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("kind", ["self", "small", "wrong"])
def test_prefill_ships_draft_kv_and_decode_speculates_exactly(arch, kind, tiny_checkpoint, drafts, references):
    """P/D in one process: a prefill engine prefills target and draft in chunks, its blocks (every layer of
    the one cache tensor) are copied into the decode engine's reserved blocks, and the decode engine
    speculates from its first step in a pool small enough to preempt (recompute runs both models). The
    target drafting for itself accepts every draft only if the draft's KV of each prompt arrived."""
    prompts, expected = references(arch)
    prefill, decode = pd_engines(arch, tiny_checkpoint(arch), drafts(arch, kind), decode_blocks=56)
    # one tensor: the target's layers, then the draft's (what the transfer ships)
    num_layers = prefill.hf_config.num_hidden_layers + prefill.draft.num_layers
    assert prefill.kv_cache.shape[0] == decode.kv_cache.shape[0] == num_layers
    preempted = record_preemptions(SimpleNamespace(engine=decode))
    free_at_start = (prefill.kv_manager.num_free_blocks, decode.kv_manager.num_free_blocks)
    first_tokens = {}
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, greedy(NUM_NEW_TOKENS), prefill_only=True)
        decode.add_request(f"r{i}", prompt, greedy(NUM_NEW_TOKENS), remote_prefill=True)
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            first_tokens[out.request_id] = out.new_token_ids[0]
    outputs = {f"r{i}": [] for i in range(len(prompts))}
    pending = dict(first_tokens)
    while decode.has_unfinished_requests():
        for seq in decode.kv.reserve_remote():
            rid = seq.request_id
            src, dst = prefill.kv_manager.block_table(rid), decode.kv_manager.block_table(rid)
            for s, d in zip(src, dst[:len(src)]):
                decode.kv_cache[:, :, d] = prefill.kv_cache[:, :, s]  # target and draft layers, like the transfer
            prefill.kv.release_blocks(rid)
            outputs[rid] += decode.kv.activate_remote(rid, pending.pop(rid), None).new_token_ids
        for out in decode.step():
            outputs[out.request_id] += out.new_token_ids
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected
    assert (prefill.kv_manager.num_free_blocks, decode.kv_manager.num_free_blocks) == free_at_start
    assert preempted and decode.speculator.stats.num_draft_tokens > 0
    if kind == "self":
        assert decode.speculator.stats.acceptance_rate == 1.0


def test_a_speculating_prefill_worker_caches_the_prompts_it_prefilled(tiny_checkpoint, drafts):
    """A prefill-only request finishes in the step that computes its last chunk, while it still holds its
    blocks for the transfer: those blocks (target and draft KV both written) go into the prefix cache, so
    the conversation's next turn computes only what is new, as without a draft model."""
    from pipeline.config import PipelineConfig
    from pipeline.engine import LLMEngine

    engine = LLMEngine(PipelineConfig.load(overrides={
        "pipeline_role": "PrefillOnly", "model": {"model_path": tiny_checkpoint("llama")},
        "draft_model": {"model_path": drafts("llama", "small")}, "speculative": {"num_speculative_tokens": K},
        "kv_cache": {"page_size": 4, "num_blocks": 64}}))
    prompt = list(range(20, 50))
    engine.add_request("turn-1", prompt, greedy(NUM_NEW_TOKENS), prefill_only=True)
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv.release_blocks("turn-1")
    assert len(engine.kv_manager.find_cached_prefix(prompt + [7, 8])) == len(prompt) // 4
