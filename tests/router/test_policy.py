"""router.policy.choose_route: a pure function of load reports."""

from __future__ import annotations

import pytest

from pipeline.config import PipelineRole
from router.policy import NoRoute, PromptTooLong, Saturated, WorkerView, choose_route

P, D, PD = PipelineRole.PrefillOnly, PipelineRole.DecodeOnly, PipelineRole.PrefillAndDecode


def w(worker_id, role, **kw) -> WorkerView:
    kw.setdefault("max_length", 1000)
    kw.setdefault("num_free_blocks", 50)
    kw.setdefault("num_total_blocks", 100)
    if role == P:
        kw.setdefault("prefill_endpoint", f"ipc:///tmp/{worker_id}")
    return WorkerView(worker_id=worker_id, role=role, **kw)


def test_disaggregated_pair_picks_least_loaded_decode_and_least_queued_prefill():
    workers = [
        w("p0", P, num_queued_prefill_tokens=500),
        w("p1", P, num_queued_prefill_tokens=20),
        w("d0", D, num_running=8),
        w("d1", D, num_running=2),
    ]
    route = choose_route(workers, num_tokens=100)
    assert route.decode.worker_id == "d1" and route.prefill.worker_id == "p1"


def test_router_side_counts_spread_a_burst_between_heartbeats():
    workers = [w("d0", D, num_inflight=3), w("d1", D), w("p0", P, num_pending_prefill_tokens=900), w("p1", P)]
    route = choose_route(workers, 10)
    assert (route.decode.worker_id, route.prefill.worker_id) == ("d1", "p1")


def test_free_blocks_break_ties_and_full_workers_go_last():
    workers = [w("d0", D, num_free_blocks=0), w("d1", D, num_free_blocks=10, num_running=5), w("d2", D, num_free_blocks=30, num_running=5), w("p", P)]
    assert choose_route(workers, 10).decode.worker_id == "d2"
    workers = [w("d0", D, num_free_blocks=0), w("d1", D, num_free_blocks=5, num_running=9), w("p", P)]
    assert choose_route(workers, 10).decode.worker_id == "d1"


def test_colocated_worker_serves_alone():
    route = choose_route([w("c0", PD)], 10)
    assert route.decode.worker_id == "c0" and route.prefill is None


def test_colocated_and_disaggregated_compete_on_load():
    workers = [w("c0", PD, num_running=10), w("d0", D, num_running=1), w("p0", P)]
    route = choose_route(workers, 10)
    assert route.decode.worker_id == "d0" and route.prefill.worker_id == "p0"


def test_without_prefill_workers_the_least_loaded_decoder_prefills_itself():
    route = choose_route([w("d0", D), w("c0", PD, num_running=30)], 10)
    assert route.decode.worker_id == "d0" and route.prefill is None


def test_decode_only_without_prefill_prefills_locally():
    route = choose_route([w("d0", D, num_running=3), w("d1", D)], 10)
    assert route.decode.worker_id == "d1" and route.prefill is None
    with pytest.raises(NoRoute, match="decode-capable"):
        choose_route([w("p0", P)], 10)
    with pytest.raises(NoRoute, match="no live workers"):
        choose_route([], 10)


def test_prefill_worker_without_endpoint_is_not_used():
    assert choose_route([w("d0", D), w("p0", P, prefill_endpoint=None)], 10).prefill is None


def test_short_prompts_are_prefilled_where_they_decode():
    workers = [w("d0", D), w("p0", P)]
    assert choose_route(workers, 40, num_prompt_tokens=32, max_local_prefill_length=32).prefill is None
    assert choose_route(workers, 40, num_prompt_tokens=33, max_local_prefill_length=32).prefill.worker_id == "p0"
    assert choose_route(workers, 40, num_prompt_tokens=8).prefill.worker_id == "p0"  # threshold 0: always remote


def test_a_long_prefill_queue_spills_prompts_to_the_decode_worker_only_when_asked():
    # the prefill worker's backlog: 1000 reported + 2000 sent since its last heartbeat
    workers = [w("d0", D, max_length=4096),
               w("p0", P, max_length=4096, num_queued_prefill_tokens=1000, num_pending_prefill_tokens=2000)]
    route = lambda prompt, **kw: choose_route(workers, prompt + 8, num_prompt_tokens=prompt, **kw)
    assert route(1000).prefill.worker_id == "p0"  # prefill_spill_tokens None: never
    assert route(952, prefill_spill_tokens=2048).prefill is None  # 0 + 952 <= 3000 - 2048
    assert route(952, prefill_spill_tokens=2048).is_spilled and not route(1000).is_spilled
    assert route(953, prefill_spill_tokens=2048).prefill.worker_id == "p0"
    # the decode worker's own backlog (reported, and local prefills sent since) counts against spilling
    busy = [w("d0", D, max_length=4096, num_queued_prefill_tokens=500, num_pending_prefill_tokens=400), workers[1]]
    assert choose_route(busy, 108, num_prompt_tokens=100, prefill_spill_tokens=2048).prefill.worker_id == "p0"
    assert choose_route(busy, 60, num_prompt_tokens=52, prefill_spill_tokens=2048).prefill is None
    # a colocated worker is not a spill target: it prefills everything it serves anyway
    assert choose_route([w("c0", PD), w("p0", P)], 10, prefill_spill_tokens=0).prefill is None


def test_a_burst_of_long_prompts_is_shared_between_prefill_and_decode_workers_by_backlog():
    """What the router's counters do between heartbeats (``InFlightRequests.assign``): twelve 1500-token prompts
    at once go to the prefill worker until its queue is ``prefill_spill_tokens`` longer than the decode
    worker's, then alternate; nothing spills while the prefill queue stays short."""
    def burst(spill, count=12, length=1500):
        backlog = {"p0": 0, "d0": 0}
        where = []
        for _ in range(count):
            workers = [w("d0", D, num_pending_prefill_tokens=backlog["d0"], max_length=4096),
                       w("p0", P, num_pending_prefill_tokens=backlog["p0"], max_length=4096)]
            route = choose_route(workers, length + 8, num_prompt_tokens=length, prefill_spill_tokens=spill)
            target = "d0" if route.prefill is None else "p0"
            backlog[target] += length
            where.append(target)
        return where

    assert burst(None) == ["p0"] * 12
    assert burst(2048)[:3] == ["p0"] * 3 and burst(2048).count("d0") == 5
    assert burst(0).count("d0") == 6  # no slack: an even split
    assert burst(2048, count=2) == ["p0", "p0"]  # a short queue: every prompt where disaggregation puts it


def test_saturated_workers_are_skipped_and_all_saturated_is_its_own_error():
    workers = [w("d0", D, num_inflight=4, max_batch_size=4), w("d1", D, num_inflight=9, max_batch_size=16), w("p0", P)]
    assert choose_route(workers, 10).decode.worker_id == "d1"
    with pytest.raises(Saturated):
        choose_route(workers[:1] + [w("p0", P)], 10)
    assert choose_route([w("d0", D, num_inflight=50)], 10).decode.worker_id == "d0"  # unknown size: never saturated


def test_max_length_and_exclusions_filter_candidates():
    workers = [w("c0", PD, max_length=64), w("c1", PD, max_length=4096, num_running=50)]
    assert choose_route(workers, 100).decode.worker_id == "c1"
    with pytest.raises(PromptTooLong, match="hold at most 4096"):
        choose_route(workers, 5000)
    assert choose_route(workers, 10, exclude={"c0"}).decode.worker_id == "c1"
    with pytest.raises(NoRoute, match="no other live worker"):
        choose_route(workers, 10, exclude={"c0", "c1"})


def test_a_worker_holding_only_the_prompt_serves_when_none_holds_the_whole_output():
    """A worker whose KV pool is shorter than the model's context registers that length; a request whose
    max_tokens (the router's default: the rest of the context) no worker holds goes to one that holds its prompt,
    which ends the output at its own length, rather than failing."""
    workers = [w("c0", PD, max_length=64), w("c1", PD, max_length=512)]
    assert choose_route(workers, 2048, num_prompt_tokens=100).decode.worker_id == "c1"
    assert choose_route(workers, 2048, num_prompt_tokens=10).decode.worker_id in ("c0", "c1")
    # a prompt no worker holds is the client's to shorten (a 400), not a worker missing (a 503)
    with pytest.raises(PromptTooLong, match="the prompt has 600 tokens; the workers serving this model hold at most "
                                            "512"):
        choose_route(workers, 2048, num_prompt_tokens=600)


def test_deterministic_on_ties():
    workers = [w("d1", D), w("d0", D), w("p1", P), w("p0", P)]
    route = choose_route(workers, 10)
    assert (route.decode.worker_id, route.prefill.worker_id) == ("d0", "p0")
