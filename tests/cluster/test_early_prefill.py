"""The router starts a disaggregated prompt on its prefill worker at once (``StartPrefill``), beside the
request to the decode worker: workers in this process, the test playing the router."""

from __future__ import annotations

import threading
import time

from pipeline.protocol import SamplingParams
from pipeline.protocol.cluster import GenerateRequest, StartPrefill
from prefill_worker.worker import PrefillWorker
from tests.cluster.test_worker_deadlines import (  # noqa: F401 (base: a fixture)
    FakeRouter,
    base,
    config,
    join_worker,
    pd_pair_with_slow_decode,
    run_in_thread,
)

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = list(range(3, 40))  # 37 tokens: 9 full pages of 4 and 1 token


def _tokens(router: FakeRouter, request_id: str, sender: str = "d0") -> list[int]:
    return [t for d, who in zip(router.deltas, router.senders) if d.request_id == request_id and who == sender
            for t in d.token_ids]


def _finished(router: FakeRouter, request_id: str) -> bool:
    return any(d.request_id == request_id and d.finish_reason is not None for d in router.deltas)


def _claimed_after_a_stall(model_path: str, base: str, monkeypatch, stall_until, hold_s: float = 2.0) -> dict:
    """Prefill "p0" and decode "d0" in this process; d0 runs a stream and, when the request "new" comes (to
    d0, and early to p0), is in a step that lasts until ``stall_until(p0)`` holds, so it asks p0 only after
    that. "local" (the same prompt, prefilled by d0 itself) is the reference. ``hold_s``: p0's
    ``router.early_prefill_hold_s``. What happened, once every block of p0 is back."""
    router = FakeRouter(base)
    prefill, decode = pd_pair_with_slow_decode(model_path, base, monkeypatch, delay_s=0.0)
    prefill.early_prefill_hold_s = hold_s
    stall_once, stalling, step, claim, claims = threading.Event(), threading.Event(), decode.engine.step, \
        prefill._claim, []

    def step_then_stall():
        outputs = step()
        if stall_once.is_set():
            stall_once.clear()
            stalling.set()
            deadline = time.monotonic() + 30
            while not stall_until(prefill) and time.monotonic() < deadline:
                time.sleep(0.01)
        return outputs

    monkeypatch.setattr(decode.engine, "step", step_then_stall)
    monkeypatch.setattr(prefill, "_claim", lambda job, *args: (claims.append(job.early_output is not None),
                                                               claim(job, *args)))
    free_at_start = prefill.engine.kv_manager.num_free_blocks
    threads = [run_in_thread(prefill), run_in_thread(decode)]
    deadline = time.monotonic() + 60
    try:
        router.pump(0.5)
        stall_once.set()  # d0's first step stalls (the stream's own: it could end before this thread looks again)
        router.send("d0", GenerateRequest(request_id="busy", prompt_token_ids=list(range(3, 12)),
                                          sampling_params=SamplingParams(max_tokens=40, temperature=0.0,
                                                                         ignore_eos=True)))
        while not stalling.is_set():
            assert time.monotonic() < deadline, "the decode worker never stalled"
            router.pump(0.02)
        router.send("d0", GenerateRequest(request_id="new", prompt_token_ids=PROMPT, sampling_params=GREEDY,
                                          prefill_worker_id="p0", prefill_endpoint=prefill.endpoint))
        router.send("p0", StartPrefill(request_id="new", prompt_token_ids=PROMPT, sampling_params=GREEDY))
        router.send("d0", GenerateRequest(request_id="local", prompt_token_ids=PROMPT, sampling_params=GREEDY))
        while not (_finished(router, "new") and _finished(router, "local")):
            assert time.monotonic() < deadline, "no answer"
            router.pump(0.1)
        while prefill.jobs or prefill.engine.kv_manager.num_free_blocks != free_at_start:
            assert time.monotonic() < deadline, "the prefill worker still holds blocks"
            router.pump(0.1)
        return {"claims": claims, "new": _tokens(router, "new"), "local": _tokens(router, "local"),
                "first_from_p0": _tokens(router, "new", sender="p0"),
                "computed": prefill.engine.num_prompt_tokens_computed,
                "unclaimed": prefill._load_report().num_early_prefills_unclaimed}
    finally:
        for stop, thread in threads:
            stop.set()
            join_worker(thread)
        router.close()


def test_the_decode_workers_request_claims_the_prefill_started_before_it_asked(tiny_checkpoint, base, monkeypatch):
    """The decode worker is in a slow step when the request comes, so it asks only after that step; by then
    the prefill worker has run the prompt it got from the router. The claim ships it at once: the prompt is
    computed once, and the tokens are those of the decode worker prefilling the same prompt itself."""
    seen = _claimed_after_a_stall(tiny_checkpoint("llama"), base, monkeypatch, stall_until=lambda prefill: (
        "new" in prefill.jobs and prefill.jobs["new"].early_output is not None),  # asks once the prefill is done
        hold_s=30.0)  # (however slow the machine, the claim comes within the hold)
    assert seen["claims"] == [True]  # claimed once, after the prefill was done
    assert seen["new"] == seen["local"] and len(seen["new"]) == 4
    assert seen["first_from_p0"] == seen["local"][:1]  # the first, streamed early
    assert seen["computed"] == len(PROMPT) and seen["unclaimed"] == 0  # once: the claim ran nothing again


def test_a_claim_after_the_hold_finds_the_prompt_cached_and_computes_only_its_last_block(tiny_checkpoint, base,
                                                                                         monkeypatch):
    """The decode worker's step outlasts the hold (a loaded machine): the early prefill ends unclaimed, its KV
    stays in the prefix cache, and the late claim runs as a new prompt that computes only the last partial
    block. The tokens are still the decode worker's own (and every block is back)."""
    seen = _claimed_after_a_stall(tiny_checkpoint("llama"), base, monkeypatch, stall_until=lambda prefill: (
        prefill.source.num_holds_expired == 1))  # asks once the hold has ended
    assert seen["claims"] == [] and seen["unclaimed"] == 1  # tandem_worker_early_prefills_unclaimed_total
    assert seen["new"] == seen["local"] and len(seen["new"]) == 4
    assert seen["computed"] == len(PROMPT) + 1  # 9 full pages of 4 from the cache, the last token again


def test_an_early_prefill_nobody_claims_ends_after_its_hold_and_leaves_its_kv_cached(tiny_checkpoint, base):
    """``router.early_prefill_hold_s`` (0.5 s here, 2 by default) after it arrived, its blocks are free again."""
    router = FakeRouter(base)
    prefill = PrefillWorker(config(tiny_checkpoint("llama"), base, "PrefillOnly", transfer={"transport": "zmq"},
                                   router={"early_prefill_hold_s": 0.5}), "p0")
    kv = prefill.engine.kv_manager
    free_at_start = kv.num_free_blocks
    stop, thread = run_in_thread(prefill)
    prompt = list(range(3, 40))  # 37 tokens: 9 full pages of 4
    try:
        router.pump(0.3)
        sent = time.monotonic()
        router.send("p0", StartPrefill(request_id="orphan", prompt_token_ids=prompt, sampling_params=GREEDY))
        while not (prefill.jobs and prefill.jobs["orphan"].early_output is not None):
            assert time.monotonic() < sent + 10, "the early prefill never ran"
            router.pump(0.02)
        assert prefill.jobs["orphan"].deadline <= time.monotonic() + 0.5  # held for the claim that long at most
        assert kv.num_free_blocks < free_at_start  # held for the decode worker's claim
        while prefill.jobs or kv.num_free_blocks != free_at_start:
            assert time.monotonic() < sent + 10, "the hold never ended"
            router.pump(0.1)
        assert time.monotonic() - sent >= 0.5
        assert prefill._load_report().num_early_prefills_unclaimed == 1  # tandem_worker_early_prefills_unclaimed
        assert len(kv.find_cached_prefix(prompt)) == len(prompt) // kv.page_size  # a later request reuses it
        assert not router.deltas  # nothing was streamed for it
    finally:
        stop.set()
        join_worker(thread)
        router.close()
