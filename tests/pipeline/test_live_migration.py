"""Live migration at the engine level: a stream paused on one engine (``pause_decoding``, a step in
flight read first) and activated on another with its KV (``activate_migrated``, nothing recomputed)
goes on exactly as the uninterrupted stream, greedy, seeded with penalties and under a grammar, with
the overlap pipeline on or off; a stream resumed where it was paused goes on exactly too. The KV is
copied tensor to tensor here; the transfer service's part is tests/cluster/test_live_migration.py."""

from __future__ import annotations

import json

import pytest

from pipeline import LLM
from pipeline.sequence import SequenceStatus
from tests.conftest import assert_no_leaks
from tests.pipeline.test_engine_exactness import make_prompts
from tests.pipeline.test_resume import CASES, run


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    def make(**config):
        return LLM(model=tiny_checkpoint("llama"), kv_cache={"page_size": 4, "num_blocks": 256}, **config).engine
    return {"source": make(), "source-overlap": make(enable_overlap_scheduler=True), "target": make()}


def decode_until(engine, request_id, num_tokens) -> list[int]:
    tokens = []
    while len(tokens) < num_tokens:
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
    return tokens


def move_with_kv(src, dst, seq, prompt, params, sent: list[int]) -> list[int]:
    """``seq``, paused on ``src`` after the output tokens ``sent``, moved to ``dst`` with its KV (the cache rows of
    its blocks copied tensor to tensor), activated there and decoded to its end; returns the tokens ``dst`` added."""
    rid = seq.request_id
    dst.add_request(rid, prompt, params, remote_prefill=True, resume_token_ids=sent)
    (reserved,) = dst.kv.reserve_remote()
    assert reserved.token_ids == seq.token_ids
    src_blocks = src.kv_manager.block_table(rid)
    dst_blocks = dst.kv_manager.block_table(rid)
    n = -(-(seq.num_tokens - 1) // src.kv_manager.page_size)  # blocks holding every token's KV but the last
    dst.kv_cache[:, :, list(dst_blocks[:n])] = src.kv_cache[:, :, list(src_blocks[:n])]
    src.abort_request(rid)  # the handoff is done: the source frees its blocks
    dst.kv.activate_migrated(rid)
    rest = []
    while dst.has_unfinished_requests():
        rest += [t for out in dst.step() if out.request_id == rid for t in out.new_token_ids]
    return rest


@pytest.mark.parametrize("source", ["source", "source-overlap"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_stream_moved_with_its_kv_goes_on_exactly(engines, source, case):
    src, dst = engines[source], engines["target"]
    free = {e: e.kv_manager.num_free_blocks for e in (src, dst)}
    # a prompt of its own, its uninterrupted run on the source: the target's prefix cache holds none of its KV
    prompt = make_prompts(300, [13], seed=len(case) + 100 * len(source))[0]
    params = CASES[case]
    whole = run(src, f"whole-{source}-{case}", prompt, params)
    rid = f"moved-{source}-{case}"
    src.add_request(rid, prompt, params)
    sent = decode_until(src, rid, 6)
    steps, paused = src.pause_decoding()  # overlap: the step in flight is read first
    sent += [t for out in steps if out.request_id == rid for t in out.new_token_ids]
    assert [seq.request_id for seq in paused] == [rid]
    seq = paused[0]
    assert seq.status is SequenceStatus.PAUSED and seq.num_computed_tokens == seq.num_tokens - 1
    assert src.step() == [] and not src.has_unfinished_requests()  # nothing decodes while paused

    rest = move_with_kv(src, dst, seq, prompt, params, sent)
    assert sent + rest == whole
    if case == "grammar":
        json.loads(dst.tokenizer.decode(sent + rest, skip_special_tokens=True))
    for engine, before in free.items():
        assert_no_leaks(engine.kv_manager, before)


@pytest.mark.parametrize("source", ["source", "source-overlap"])
def test_a_paused_stream_resumed_in_place_goes_on_exactly(engines, source):
    engine = engines[source]
    free = engine.kv_manager.num_free_blocks
    prompt = make_prompts(300, [9], seed=5)[0]
    params = CASES["seeded with penalties"]
    whole = run(engine, f"whole-in-place-{source}", prompt, params)
    rid = f"paused-{source}"
    engine.add_request(rid, prompt, params)
    tokens = decode_until(engine, rid, 4)
    steps, paused = engine.pause_decoding()
    tokens += [t for out in steps if out.request_id == rid for t in out.new_token_ids]
    assert [seq.request_id for seq in paused] == [rid]
    engine.kv.resume_paused(rid)  # the router declined the offer
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() if out.request_id == rid for t in out.new_token_ids]
    assert tokens == whole
    assert_no_leaks(engine.kv_manager, free)


def test_only_decoding_single_choice_streams_pause(engines):
    engine = engines["source"]
    prompt = make_prompts(300, [40], seed=1)[0]
    engine.add_request("n2", prompt, CASES["greedy"].__class__(max_tokens=8, n=2, temperature=0.0))
    engine.add_request("fresh", prompt, CASES["greedy"])
    _, paused = engine.pause_decoding()  # nothing has decoded yet
    assert paused == []
    while engine.has_unfinished_requests():
        engine.step()
