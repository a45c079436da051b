"""KV-aware routing's pure parts: the prefix cache's event log, the router's index of it, and the
policy's cost of (prompt blocks a worker must compute or receive) against (blocks its requests hold);
last, the router's own count of those blocks, with scripted workers."""

from __future__ import annotations

import threading

import openai
import pytest

from pipeline.config import PipelineRole
from pipeline.kv_cache import KVCacheManager
from router.kv_index import KVIndex, PromptHashes
from pipeline.protocol.cluster import KVEvents, encode
from router.policy import WorkerView, choose_route
from tests.router.fake_worker import held

P, D, PD = PipelineRole.PrefillOnly, PipelineRole.DecodeOnly, PipelineRole.PrefillAndDecode
PAGE = 4


def w(worker_id, role, **kw) -> WorkerView:
    kw.setdefault("max_length", 1000)
    kw.setdefault("num_free_blocks", 90)
    kw.setdefault("num_total_blocks", 100)
    kw.setdefault("page_size", PAGE)
    if role == P:
        kw.setdefault("prefill_endpoint", f"ipc:///tmp/{worker_id}")
    return WorkerView(worker_id=worker_id, role=role, **kw)


def test_the_event_log_follows_the_prefix_cache():
    kv = KVCacheManager(num_blocks=4, page_size=PAGE)
    kv.record_events()
    tokens = list(range(13))
    kv.allocate("a", tokens, 13)
    kv.register_computed("a", tokens, 13)  # three full blocks published
    stored, removed = kv.drain_events()
    assert stored == PromptHashes(tokens + [0]).hashes(PAGE) and removed == []
    assert kv.drain_events() == ([], [])
    kv.free("a")
    other = [100 + t for t in range(13)]
    kv.allocate("b", other, 13)  # needs all 4 blocks: the cached ones are evicted, then its own published
    kv.register_computed("b", other, 8)
    stored, removed = kv.drain_events()
    assert sorted(removed) == sorted(PromptHashes(tokens + [0]).hashes(PAGE))
    assert stored == PromptHashes(other[:8] + [0]).hashes(PAGE)
    assert sorted(kv.cached_hashes()) == sorted(stored)


def test_a_hash_published_and_forgotten_between_drains_is_reported_once_in_its_last_state():
    kv = KVCacheManager(num_blocks=2, page_size=PAGE)
    kv.record_events()
    kv.allocate("a", list(range(5)), 5)
    kv.register_computed("a", list(range(5)), 4)
    kv.free("a")
    kv.allocate("b", list(range(50, 58)), 8)  # evicts a's block
    assert kv.drain_events() == ([], [PromptHashes(list(range(5))).hashes(PAGE)[0]])


def test_the_index_counts_leading_blocks_and_forgets():
    index = KVIndex()
    index.register("w", PAGE, num_total_blocks=8)
    prompt = PromptHashes(list(range(21)))  # 5 full blocks before the last token
    hashes = prompt.hashes(PAGE)
    assert len(hashes) == 5
    assert index.apply("w", 0, hashes[:3], [], full=True)
    assert index.cached_prefix_tokens("w", prompt) == 12
    assert index.apply("w", 1, [hashes[4]], [hashes[1]], full=False)
    assert index.cached_prefix_tokens("w", prompt) == 4  # the chain breaks at block 1
    assert not index.apply("w", 5, [hashes[1]], [], full=False)  # a gap: emptied until a snapshot
    assert index.cached_prefix_tokens("w", prompt) == 0
    assert index.apply("w", 0, hashes, [], full=True) and index.num_blocks("w") == 5
    assert index.apply("w", 1, [bytes([i]) * 16 for i in range(9)], [], full=False)
    assert index.num_blocks("w") == 8  # never more than the worker has
    index.forget("w")
    assert index.cached_prefix_tokens("w", prompt) == 0 and not index.apply("w", 2, hashes, [], full=False)


def test_the_worker_holding_the_prompt_wins_until_its_load_outweighs_it():
    prompt = 400  # 100 blocks of 4
    warm = w("d0", PD, num_cached_prompt_tokens=380, num_free_blocks=60)  # 40 blocks busy
    cold = w("d1", PD, num_free_blocks=100)
    assert choose_route([warm, cold], prompt + 10, num_prompt_tokens=prompt, kv_overlap_weight=1.0).decode is warm
    busy = w("d0", PD, num_cached_prompt_tokens=380, num_free_blocks=1)  # 99 blocks busy: 5 + 99 > 100 + 0
    assert choose_route([busy, cold], prompt + 10, num_prompt_tokens=prompt, kv_overlap_weight=1.0).decode is cold
    # load alone (the setting off) ignores the cache: the emptier worker
    assert choose_route([warm, cold], prompt + 10, num_prompt_tokens=prompt).decode is cold


def test_a_burst_spreads_by_the_routers_own_block_counts():
    fresh = [w("d0", PD, num_inflight_blocks=30), w("d1", PD)]
    assert choose_route(fresh, 50, num_prompt_tokens=40, kv_overlap_weight=1.0).decode.worker_id == "d1"


def test_prefill_worker_by_cache_and_local_prefill_by_uncached_length():
    workers = [w("p0", P, num_cached_prompt_tokens=0), w("p1", P, num_cached_prompt_tokens=96),
               w("d0", D, num_cached_prompt_tokens=0)]
    route = choose_route(workers, 110, num_prompt_tokens=100, kv_overlap_weight=1.0, max_local_prefill_length=8)
    assert route.prefill.worker_id == "p1"
    warm_decode = [w("p0", P), w("d0", D, num_cached_prompt_tokens=96)]  # 4 uncached tokens: prefill here
    route = choose_route(warm_decode, 110, num_prompt_tokens=100, kv_overlap_weight=1.0, max_local_prefill_length=8)
    assert route.prefill is None and route.decode.worker_id == "d0"
    route = choose_route(warm_decode, 110, num_prompt_tokens=100, max_local_prefill_length=8)  # load alone
    assert route.prefill is not None


@pytest.mark.parametrize("max_tokens, second_on", [(4, "a-cached"), (50, "b-cold")])
def test_a_long_generation_weighs_as_the_kv_it_may_grow_to(router, max_tokens, second_on):
    """Two requests whose prompt only worker a caches (page 4: 2 of its 3 blocks): short ones both go to a
    (a cached block outweighs a short request's load); long ones spread, because the router counts a
    request at its prompt plus max_tokens, the KV it may grow to, not at its prompt alone."""
    prompt = list(range(40, 49))  # 9 tokens
    cached = PromptHashes(prompt).hashes(4)
    a = router.add_worker("a-cached", script=held, role=PipelineRole.DecodeOnly, page_size=4, max_length=1024)
    b = router.add_worker("b-cold", script=held, role=PipelineRole.DecodeOnly, page_size=4, max_length=1024)
    a.send_raw(encode(KVEvents(worker_id="a-cached", seq=0, stored=cached, full=True)))
    assert a.wait_for(lambda: router.state.dispatcher.registry.kv_index.num_blocks("a-cached") == len(cached))
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=10)

    def send() -> None:  # held until the workers stop with the test
        try:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens)
        except openai.APIError:
            pass

    for _ in range(2):
        threading.Thread(target=send, daemon=True).start()
        assert a.wait_for(lambda n=len(a.requests) + len(b.requests): len(a.requests) + len(b.requests) > n)
    assert len(a.requests) == 1 + (second_on == "a-cached") and len(b.requests) == (second_on == "b-cold")
