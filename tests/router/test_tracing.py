"""The router's side of a request's trace: its spans (the request under the client's ``traceparent``, the
queue, the routing decision) and the trace context it sends the workers; nothing of it with tracing off."""

from __future__ import annotations

import httpx
from opentelemetry.trace import SpanKind, StatusCode

from pipeline.config import PipelineRole
from pipeline.protocol.cluster import FinishCode, TokenDelta
from tests.router.fake_worker import held, tokens_script
from tests.router.test_admission import in_thread
from tests.tracing_support import in_memory_tracing

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
HEADERS = {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"}


def _pd_router(router_factory):
    router = router_factory(config={"router": {"max_local_prefill_length": 0, "early_prefill": True}})
    prefill = router.add_worker("p0", role=PipelineRole.PrefillOnly, prefill_endpoint="ipc:///tmp/p0-trace")
    decode = router.add_worker("d0", role=PipelineRole.DecodeOnly, script=tokens_script([10, 11, 12]))
    return router, prefill, decode


def _complete(router) -> dict:
    response = httpx.post(f"{router.url}/v1/completions", headers=HEADERS, timeout=10,
                          json={"model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 3})
    assert response.status_code == 200, response.text
    return response.json()


def test_tracing_off_sends_no_trace_context(router_factory):
    router, prefill, decode = _pd_router(router_factory)
    _complete(router)
    assert prefill.wait_for(lambda: prefill.early_starts)
    assert decode.requests[0].trace_context is None and prefill.early_starts[0].trace_context is None


def test_the_request_continues_the_client_trace_and_its_workers_join_it(router_factory):
    with in_memory_tracing("tandem-router", "router") as log:
        router, prefill, decode = _pd_router(router_factory)
        body = _complete(router)
        router.wait_idle()
        assert prefill.wait_for(lambda: prefill.early_starts)
        spans = {s.name: s for s in log.spans()}
    request = spans["tandem.request"]
    assert request.kind is SpanKind.SERVER and request.status.status_code is StatusCode.UNSET
    assert format(request.context.trace_id, "032x") == CLIENT_TRACE_ID
    assert format(request.parent.span_id, "016x") == CLIENT_SPAN_ID
    assert request.attributes["tandem.request_id"] == body["id"] and request.attributes["tandem.outcome"] == "finished"
    assert request.attributes["tandem.num_output_tokens"] == 3
    for name in ("router.queue", "router.route"):
        assert spans[name].parent.span_id == request.context.span_id
    route = spans["router.route"].attributes
    assert route["tandem.decode_worker"] == "d0" and route["tandem.prefill_worker"] == "p0"
    assert route["tandem.attempt"] == 1 and not route["tandem.local_prefill"]
    # the workers' spans are children of the request span: its context is what both messages carry
    want = f"00-{CLIENT_TRACE_ID}-{format(request.context.span_id, '016x')}-01"
    assert decode.requests[0].trace_context["traceparent"] == want
    assert prefill.early_starts[0].trace_context["traceparent"] == want


def test_a_migrated_stream_stays_in_its_trace_with_a_span_per_move(router_factory, served_model):
    """A draining worker's stream is handed off, then its source dies before the target had the KV: two
    moves (drain, then worker_died and a replay), each a router.migration span; every attempt's
    GenerateRequest carries the same request context, so all the workers' spans stay in one trace."""
    from tests.router.test_handoff import DECODE, rest_after_resume, start_on, stream_in_background
    from tests.router.fake_worker import held

    ids = served_model.tokenizer.encode("Hello there, how are you? Paris is")[:12]
    with in_memory_tracing("tandem-router", "router") as log:
        router = router_factory()
        source = router.add_worker("a-dying", script=held, role=DECODE)
        target = router.add_worker("b-survivor", script=rest_after_resume(ids, only_replay=True), role=DECODE)
        result = stream_in_background(router)
        start_on(source, ids, 4)
        assert target.wait_for(lambda: target.requests)
        source.stop()  # silent from now on: declared dead before the target had the KV
        result["thread"].join(timeout=20)
        assert "error" not in result, result
        router.wait_idle()
        spans = log.spans()
    [request] = [s for s in spans if s.name == "tandem.request"]
    moves = sorted((s for s in spans if s.name == "router.migration"), key=lambda s: s.start_time)
    assert [m.attributes["tandem.migration.cause"] for m in moves] == ["drain", "worker_died"]
    assert all(m.attributes["tandem.migration.to_worker"] == "b-survivor" for m in moves)  # handed off, replayed
    assert all(m.attributes["tandem.migration.from_worker"] == "a-dying" for m in moves)
    assert all(m.attributes["tandem.migration.num_output_tokens"] == 4 for m in moves)
    routes = sorted((s for s in spans if s.name == "router.route"), key=lambda s: s.start_time)
    assert [r.attributes["tandem.decode_worker"] for r in routes] == ["a-dying", "b-survivor"]
    assert all(s.parent.span_id == request.context.span_id for s in moves + routes)
    # the move is the pause: over when the first token after it came, after the replay was routed
    assert routes[1].end_time <= moves[1].end_time <= request.end_time
    contexts = {r.trace_context["traceparent"].rsplit("-", 1)[0] for r in source.requests + target.requests}
    assert contexts == {f"00-{format(request.context.trace_id, '032x')}-{format(request.context.span_id, '016x')}"}


def test_a_request_that_fails_ends_its_span_as_an_error_named_like_its_http_status(router_factory):
    """Timed out (504), turned away (429) and with no worker to serve it (503): each has its span, with ERROR
    status and the outcome; a timeout is not a cancellation."""
    post = lambda router: httpx.post(f"{router.url}/v1/completions", timeout=10,  # noqa: E731
                                     json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3})
    with in_memory_tracing("tandem-router", "router") as log:
        router = router_factory(request_timeout_s=0.5, max_queued_requests=0)
        worker = router.add_worker(script=held, max_batch_size=1)
        timed_out = in_thread(post, router)
        assert worker.wait_for(lambda: worker.requests)
        assert post(router).status_code == 429  # the only slot is taken, and nothing may wait
        assert timed_out.join().status_code == 504
        empty = router_factory()
        assert post(empty).status_code == 503
        router.wait_idle()
        spans = [s for s in log.spans() if s.name == "tandem.request"]
    outcomes = sorted(s.attributes["tandem.outcome"] for s in spans)
    assert outcomes == ["failed (429)", "failed (503)", "timeout"]
    assert all(s.status.status_code is StatusCode.ERROR and s.status.description for s in spans)


def _two_choices(request):
    """Three tokens for each of two choices (n=2), the choices' deltas interleaved."""
    return [(0.005 * (step + 1), TokenDelta(request_id=request.request_id, token_ids=[20 + step], index=index,
                                            finish_reason=FinishCode.LENGTH if step == 2 else None,
                                            num_prompt_tokens=len(request.prompt_token_ids) if step == 0 else 0))
            for step in range(3) for index in (0, 1)]


def test_a_request_of_several_choices_counts_every_choice_s_tokens(router_factory):
    """n=2: the request span counts both choices' tokens (the router keeps the token ids of n=1 only)."""
    with in_memory_tracing("tandem-router", "router") as log:
        router = router_factory()
        router.add_worker(script=_two_choices)
        response = httpx.post(f"{router.url}/v1/completions", timeout=10,
                              json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "n": 2})
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 2
        router.wait_idle()
        request = next(s for s in log.spans() if s.name == "tandem.request")
    assert request.attributes["tandem.outcome"] == "finished"
    assert request.attributes["tandem.num_output_tokens"] == 6


def test_a_refused_request_has_one_span_in_the_client_s_trace(router_factory):
    """Refused before it became a request (an unknown field, 400): a span of its own under the client's trace.
    Refused after it was submitted (its RequestTrace then ends it): no second span."""
    from router.request_trace import REQUEST_TRACED, trace_rejection

    with in_memory_tracing("tandem-router", "router") as log:
        router = router_factory()
        router.add_worker(script=tokens_script([10]))
        bad_field = httpx.post(f"{router.url}/v1/completions", headers=HEADERS, timeout=10,
                               json={"model": "tiny", "prompt": [1, 2], "max_tokens": 3, "bogus_field": 1})
        assert bad_field.status_code == 400, bad_field.text
        router.wait_idle()
        headers = [(b"traceparent", HEADERS["traceparent"].encode())]
        trace_rejection(400, {"path": "/v1/completions", "headers": headers, "state": {REQUEST_TRACED: True}}, 0)
        spans = [s for s in log.spans() if s.name == "tandem.request"]
    refused, = spans
    assert refused.attributes["tandem.outcome"] == "rejected (400)"
    assert format(refused.context.trace_id, "032x") == CLIENT_TRACE_ID
    assert format(refused.parent.span_id, "016x") == CLIENT_SPAN_ID
    assert refused.kind is SpanKind.SERVER and refused.status.status_code is StatusCode.ERROR
    assert refused.attributes["http.route"] == "/v1/completions" and refused.end_time >= refused.start_time
