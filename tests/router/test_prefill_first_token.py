"""Latency under P/D at the router (fake workers): the prompt starts on the prefill worker at once
(``StartPrefill``), and its first token streams before the decode worker has the KV."""

from __future__ import annotations

import threading

import openai

from pipeline.config import PipelineRole
from pipeline.protocol.cluster import FinishCode, TokenDelta
from pipeline.protocol.requests import TokenLogprob
from tests.router.fake_worker import held

PROMPT = list(range(40, 52))


def _pd(router):
    prefill = router.add_worker("p0", role=PipelineRole.PrefillOnly, prefill_endpoint="ipc:///tmp/p0-first",
                                script=held)
    decode = router.add_worker("d0", role=PipelineRole.DecodeOnly, script=held)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=10)
    return prefill, decode, client


def _lp(token_id: int, logprob: float) -> list[TokenLogprob]:
    return [TokenLogprob(token_id, logprob), TokenLogprob(token_id + 1, logprob - 1.0)]


def _stream(client, chunks: list, done: threading.Event, **kw) -> threading.Thread:
    def run():
        try:
            for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, stream=True,
                                                   logprobs=1, **kw):
                chunks.append(chunk)
        finally:
            done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _text(chunks) -> str:
    return "".join(c.choices[0].text for c in chunks if c.choices)


def _tokens(chunks) -> list[str]:
    return [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]


def _decode_answer(rid: str, first_too: bool = True) -> list[TokenDelta]:
    """What a decode worker sends: the first token (the one PrefillDone brought), then its own."""
    first = [TokenDelta(request_id=rid, token_ids=[21], logprobs=[_lp(21, -0.5)], num_prompt_tokens=len(PROMPT),
                        num_cached_tokens=5)] if first_too else []
    return first + [TokenDelta(request_id=rid, token_ids=[22], logprobs=[_lp(22, -0.6)]),
                    TokenDelta(request_id=rid, token_ids=[23], logprobs=[_lp(23, -0.7)], finish_reason=FinishCode.LENGTH)]


def _streaming(router_factory, config: dict | None = None, **kw):
    """A P/D pair of fake workers, and a stream whose request the decode worker has (nothing sent yet):
    (router, prefill, decode, chunks, done, the request's wire id)."""
    router = router_factory(**({"config": config} if config else {}))
    prefill, decode, client = _pd(router)
    chunks, done = [], threading.Event()
    _stream(client, chunks, done, **kw)
    assert decode.wait_for(lambda: decode.requests)
    return router, prefill, decode, chunks, done, decode.requests[0].request_id


def _prefill_first_token(rid: str) -> TokenDelta:
    """What the prefill worker sends the router beside the KV."""
    return TokenDelta(request_id=rid, token_ids=[21], logprobs=[_lp(21, -0.5)], num_prompt_tokens=len(PROMPT))


def _reference(router_factory) -> list:
    """The stream when the decode worker alone sends every token (as before prefill workers streamed)."""
    _router, _prefill, decode, chunks, done, rid = _streaming(router_factory)
    decode.emit(*_decode_answer(rid))
    assert done.wait(10)
    return chunks


def test_the_prefill_workers_first_token_streams_before_the_decode_worker_sends_anything(router_factory):
    reference = _reference(router_factory)
    router, prefill, decode, chunks, done, rid = _streaming(router_factory)
    prefill.emit(_prefill_first_token(rid))
    assert decode.wait_for(lambda: _tokens(chunks))  # the client has it; the decode worker has sent nothing
    assert router.metric("tandem_prefill_first_tokens_total") == 1
    decode.emit(*_decode_answer(rid))  # its first delta repeats the token: dropped, not streamed twice
    assert done.wait(10)
    assert _tokens(chunks) == _tokens(reference) and len(_tokens(chunks)) == 3
    assert _text(chunks) == _text(reference)
    assert prefill.cancels == [] and decode.cancels == []


def test_a_first_token_the_decode_worker_sent_first_is_not_repeated(router_factory):
    reference = _reference(router_factory)
    router, prefill, decode, chunks, done, rid = _streaming(router_factory)
    answer = _decode_answer(rid)
    decode.emit(answer[0])
    assert decode.wait_for(lambda: _tokens(chunks))
    prefill.emit(_prefill_first_token(rid))  # late: ignored
    decode.emit(*answer[1:])
    assert done.wait(10)
    assert _tokens(chunks) == _tokens(reference)
    assert router.metric("tandem_prefill_first_tokens_total") == 0
    assert prefill.cancels == []  # a late first token is no reason to cancel anything on the prefill worker


def test_a_transfer_that_fails_after_the_streamed_first_token_resumes_after_it(router_factory):
    reference = _reference(router_factory)
    router, prefill, decode, chunks, done, rid = _streaming(router_factory)
    prefill.emit(_prefill_first_token(rid))
    assert decode.wait_for(lambda: _tokens(chunks))
    decode.emit(TokenDelta(request_id=rid, finish_reason=FinishCode.ERROR, error="KV transfer failed: checksum",
                           retryable=True, is_prefill_failure=True))
    # the stream goes on after the token the client has: a migration by replay (the only decode worker,
    # prefilling locally since the failed prefill worker is avoided)
    assert decode.wait_for(lambda: len(decode.requests) == 2)
    retry = decode.requests[1]
    assert retry.resume_token_ids == [21] and retry.prefill_endpoint is None
    decode.emit(*_decode_answer(retry.request_id, first_too=False))
    assert done.wait(10)
    assert _tokens(chunks) == _tokens(reference)
    assert router.metric("tandem_prefill_first_tokens_total") == 1


def test_no_streamed_first_token_for_several_choices_or_without_migrations(router_factory):
    for config, kw in (({}, {"n": 2}), ({"router": {"max_local_prefill_length": 0, "max_migrations": 0}}, {})):
        router, prefill, decode, chunks, done, rid = _streaming(router_factory, config, **kw)
        prefill.emit(_prefill_first_token(rid))
        assert not decode.wait_for(lambda: _tokens(chunks), timeout=0.3)  # only the decode worker's tokens stream
        for index in range(kw.get("n", 1)):
            decode.emit(*[TokenDelta(request_id=d.request_id, token_ids=d.token_ids, logprobs=d.logprobs,
                                     finish_reason=d.finish_reason, index=index) for d in _decode_answer(rid)])
        assert done.wait(10)
        assert len(_tokens(chunks)) == 3 * kw.get("n", 1)
        assert router.metric("tandem_prefill_first_tokens_total") == 0


def test_the_prompt_goes_to_the_prefill_worker_as_the_request_goes_to_the_decode_worker(router_factory):
    for early in (True, False):
        config = {"router": {"max_local_prefill_length": 0, "early_prefill": early}}
        router, prefill, decode, chunks, done, rid = _streaming(router_factory, config, temperature=0.5)
        if early:
            assert prefill.wait_for(lambda: prefill.early_starts)
            [start] = prefill.early_starts
            assert (start.request_id, start.prompt_token_ids) == (rid, PROMPT)
            assert start.sampling_params == decode.requests[0].sampling_params  # what the decode worker asks for
        decode.emit(*_decode_answer(rid))
        assert done.wait(10)
        assert prefill.early_starts == ([start] if early else [])


def test_with_a_spill_threshold_a_prompt_behind_a_long_prefill_queue_is_prefilled_by_its_decode_worker(router_factory):
    """``router.prefill_spill_tokens``: the router's own count of what it sent the prefill worker (no heartbeat
    has reported it yet) makes the second prompt of a burst go to the decode worker alone; its first token
    releases the decode worker's backlog, and the next prompt goes through the prefill worker again."""
    router = router_factory(config={"router": {"max_local_prefill_length": 0, "prefill_spill_tokens": 0}})
    prefill, decode, client = _pd(router)
    threads, results = [], []
    for _ in range(2):
        chunks, done = [], threading.Event()
        threads.append(_stream(client, chunks, done))
        results.append((chunks, done))
        assert decode.wait_for(lambda: len(decode.requests) == len(threads))
    first, second = decode.requests
    assert first.prefill_worker_id == "p0" and second.prefill_worker_id is None and second.prefill_endpoint is None
    assert router.metric("tandem_prefill_spills_total") == 1
    for request in (first, second):
        decode.emit(*_decode_answer(request.request_id))
    for (chunks, done), thread in zip(results, threads):
        assert done.wait(10) and _text(chunks)
        thread.join(5)
    router.wait_idle()
    chunks, done = [], threading.Event()
    _stream(client, chunks, done).join(0)
    assert decode.wait_for(lambda: len(decode.requests) == 3)
    assert decode.requests[2].prefill_worker_id == "p0"  # both backlogs back to 0: the prefill worker again
    assert router.metric("tandem_prefill_spills_total") == 1
    decode.emit(*_decode_answer(decode.requests[2].request_id))
    assert done.wait(10)
