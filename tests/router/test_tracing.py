"""The router's side of a request's trace: its spans (the request under the client's ``traceparent``, the
queue, the routing decision) and the trace context it sends the workers; nothing of it with tracing off."""

from __future__ import annotations

import httpx

from pipeline.config import PipelineRole
from tests.router.fake_worker import tokens_script
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
