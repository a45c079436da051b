"""KV-aware routing's pure parts: the prefix cache's event log, the router's index of it, and the
policy's cost of (prompt blocks a worker must compute or receive) against (blocks its requests hold);
last, the router's own count of those blocks, with scripted workers."""

from __future__ import annotations

import threading
import time

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
def test_a_long_generation_weighs_as_the_kv_it_may_grow_to(router_factory, max_tokens, second_on):
    """Two requests whose prompt only worker a caches (page 4: 2 of its 3 blocks): short ones both go to a
    (a cached block outweighs a short request's load); long ones spread, because the router counts a
    request at its prompt plus max_tokens, the KV it may grow to, not at its prompt alone."""
    # the router's own request timeout as long as the waits below: a request held up for seconds by a busy machine
    # (queued for admission) must still land rather than time out in the router after the default 10 s
    router = router_factory(config={"router": {"max_local_prefill_length": 0, "kv_overlap_weight": 4.0}},
                            request_timeout_s=90)
    prompt = list(range(40, 49))  # 9 tokens
    cached = PromptHashes(prompt).hashes(4)
    a = router.add_worker("a-cached", script=held, role=PipelineRole.DecodeOnly, page_size=4, max_length=1024)
    b = router.add_worker("b-cold", script=held, role=PipelineRole.DecodeOnly, page_size=4, max_length=1024)
    a.send_raw(encode(KVEvents(worker_id="a-cached", seq=0, stored=cached, full=True)))
    assert a.wait_for(lambda: router.state.dispatcher.registry.kv_index.num_blocks("a-cached") == len(cached))
    # where the requests land is the point, not how soon: a machine busy with other tests' clusters can hold a
    # request's HTTP round trip, or a fake worker's heartbeat (then the request waits for admission), for seconds
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=90)

    def send() -> None:  # held until the workers stop with the test
        try:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens)
        except openai.APIError:
            pass

    for _ in range(2):
        threading.Thread(target=send, daemon=True).start()
        assert a.wait_for(lambda n=len(a.requests) + len(b.requests): len(a.requests) + len(b.requests) > n,
                          timeout=60)
    assert len(a.requests) == 1 + (second_on == "a-cached") and len(b.requests) == (second_on == "b-cold")


def _pd_pair(router, decode_script):
    prefill = router.add_worker("p0", role=PipelineRole.PrefillOnly, prefill_endpoint="ipc:///tmp/p0-warm")
    router.add_worker("d0", role=PipelineRole.DecodeOnly, script=decode_script)
    return prefill, openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=10)


def _choices_script(request):
    """Four tokens per choice, every choice of the request (n > 1 too)."""
    from pipeline.protocol.cluster import FinishCode, TokenDelta

    out = []
    for index in range(request.sampling_params.n):
        for i, token_id in enumerate([21, 22, 23, 24]):
            out.append((0.005 * (i + 1), TokenDelta(
                request_id=request.request_id, token_ids=[token_id], index=index,
                finish_reason=FinishCode.LENGTH if i == 3 else None,
                num_prompt_tokens=len(request.prompt_token_ids) if i == 0 else 0)))
    return out


def test_a_disaggregated_turn_that_ends_warms_its_prefill_worker_with_prompt_and_answer(router):
    prefill, client = _pd_pair(router, _choices_script)
    prompt = list(range(40, 52))
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
    assert out.choices[0].finish_reason == "length"
    assert prefill.wait_for(lambda: prefill.warmups == [prompt + [21, 22, 23, 24]])
    assert router.metric("tandem_prefill_warmups_total") == 1
    # n > 1: which answer the conversation keeps is the client's choice, so nothing is warmed
    client.completions.create(model="tiny", prompt=prompt, max_tokens=4, n=2)
    assert router.metric("tandem_prefill_warmups_total") == 1 and len(prefill.warmups) == 1


def test_no_warmup_for_a_failed_turn_or_when_switched_off(router_factory):
    from pipeline.protocol.cluster import FinishCode
    from tests.router.fake_worker import tokens_script

    router = router_factory()
    prefill, client = _pd_pair(router, tokens_script([21, 22], finish=FinishCode.ERROR))
    with pytest.raises(openai.APIError):
        client.completions.create(model="tiny", prompt=list(range(40, 52)), max_tokens=2)
    off = router_factory(config={"router": {"max_local_prefill_length": 0, "warm_prefill_cache": False}})
    off_prefill, off_client = _pd_pair(off, tokens_script([21, 22]))
    off_client.completions.create(model="tiny", prompt=list(range(40, 52)), max_tokens=2)
    time.sleep(0.3)
    assert prefill.warmups == [] and off_prefill.warmups == []


def test_a_prefix_two_decode_workers_hold_is_popular_and_prefill_workers_lacking_it_are_named():
    from router.policy import Route, popular_prefix_gaps

    system = 256  # every conversation opens with it: both decode workers hold it, each its own conversations too
    views = [w("d0", D, num_cached_prompt_tokens=900), w("d1", D, num_cached_prompt_tokens=system),
             w("p0", P, num_cached_prompt_tokens=900), w("p1", P, num_cached_prompt_tokens=16),
             w("p2", P, num_cached_prompt_tokens=system), w("p3", P, is_draining=True)]
    route = choose_route(views, 1000, num_prompt_tokens=960, kv_overlap_weight=4.0)
    assert route.prefill.worker_id == "p0"
    num_tokens, lacking = popular_prefix_gaps(views, route)
    assert num_tokens == system and [v.worker_id for v in lacking] == ["p1"]
    # one decode worker holds it: a conversation's own history, nothing to spread; no prefill worker: nothing
    assert popular_prefix_gaps([views[0], w("d1", D), *views[2:]], route) == (0, [])
    assert popular_prefix_gaps(views, Route(decode=views[0], prefill=None)) == (0, [])


def test_a_prefill_worker_lacking_the_shared_system_prompt_is_asked_to_warm_it(router):
    """Without it, every new conversation would go to the prefill worker that cached the system prompt
    first, and stay there with its later turns."""
    system = list(range(100, 116))  # 4 blocks of 4
    hashes = PromptHashes(system + [0]).hashes(PAGE)
    workers = {}
    for name, role, holds in (("d0", D, True), ("d1", D, True), ("p0", P, True), ("p1", P, False)):
        extra = {"prefill_endpoint": f"ipc:///tmp/{name}-spread"} if role == P else {}
        workers[name] = router.add_worker(name, role=role, page_size=PAGE, max_length=1024, script=held, **extra)
        if holds:
            workers[name].send_raw(encode(KVEvents(worker_id=name, seq=0, stored=hashes, full=True)))
    index = router.state.dispatcher.registry.kv_index
    assert workers["d0"].wait_for(lambda: all(index.num_blocks(n) == 4 for n in ("d0", "d1", "p0")))
    # where the requests land is the point, not how soon: a machine busy with other tests' clusters can hold a
    # request's HTTP round trip, or a fake worker's heartbeat (then the request waits for admission), for seconds
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=90)

    def send() -> None:  # held until the workers stop with the test
        try:
            client.completions.create(model="tiny", prompt=system + [7, 8, 9, 10], max_tokens=2)
        except openai.APIError:
            pass

    for _ in range(2):
        threading.Thread(target=send, daemon=True).start()
    p1 = workers["p1"]
    assert p1.wait_for(lambda: p1.warmups == [system])
    time.sleep(0.3)  # the second request within the resend window: asked once
    assert p1.warmups == [system] and workers["p0"].warmups == []
    assert router.metric("tandem_prefix_spreads_total") == 1
