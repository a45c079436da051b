"""pipeline.tracing: off by default at no cost (nothing imported, shared no-op objects), and when on, spans
whose parents are what a request's trace needs (a W3C carrier from the wire or a client, a request's open
spans on a worker)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

from pipeline import tracing
from pipeline.tracing.otlp import traces_url
from tests.tracing_support import in_memory_tracing

CLIENT_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"


def test_off_imports_no_sdk_and_hands_out_no_ops():
    code = """
import sys
import deploy.serve_cmds, router.app
from pipeline import tracing
from router.request_trace import NO_TRACE, request_trace
assert tracing.configure(None, "tandem-router") is False and not tracing.is_enabled()
assert tracing.start_span("x", parent={"traceparent": "00-%s-%s-01"}) is tracing.NOOP_SPAN
assert tracing.inject(tracing.NOOP_SPAN) is None
assert tracing.request_spans() is tracing.NOOP_REQUEST_SPANS
assert request_trace("r", 3, 4, 0, {"traceparent": "x"}) is NO_TRACE and NO_TRACE.context is None
sdk = ("opentelemetry.sdk", "opentelemetry.exporter", "pipeline.tracing.otlp")
loaded = [m for m in sys.modules if m.startswith(sdk)]
assert not loaded, loaded
""" % (CLIENT_TRACE_ID, CLIENT_SPAN_ID)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_traces_url_adds_the_otlp_path_to_a_base_url():
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://c.example/otlp/v1/traces") == "https://c.example/otlp/v1/traces"
    assert traces_url("https://gateway.example/otlp") == "https://gateway.example/otlp/v1/traces"  # a prefix
    assert traces_url("http://collector:4318/otlp/") == "http://collector:4318/otlp/v1/traces"


def test_a_client_traceparent_is_continued_and_injected_for_the_wire():
    with in_memory_tracing() as log:
        root = tracing.start_span("tandem.request", parent={"traceparent": CLIENT_TRACEPARENT})
        carrier = tracing.inject(root)
        child = tracing.start_span("decode", parent=carrier)  # as a worker does from a message's trace_context
        child.end()
        root.end()
        spans = {s.name: s for s in log.spans()}
    request, decode = spans["tandem.request"], spans["decode"]
    assert format(request.context.trace_id, "032x") == CLIENT_TRACE_ID
    assert format(request.parent.span_id, "016x") == CLIENT_SPAN_ID and request.parent.is_remote
    assert decode.context.trace_id == request.context.trace_id and decode.parent.span_id == request.context.span_id
    assert carrier["traceparent"].split("-")[2] == format(request.context.span_id, "016x")
    assert request.resource.attributes["service.name"] == "tandem-test"
    assert request.resource.attributes["tandem.worker_id"] == "w0"


def test_a_span_without_parent_starts_a_new_trace():
    with in_memory_tracing() as log:
        tracing.start_span("a").end()
        tracing.start_span("b").end()
        a, b = log.spans()
    assert a.parent is None and b.parent is None and a.context.trace_id != b.context.trace_id


def test_request_spans_follow_a_request_through_a_worker_loop():
    with in_memory_tracing() as log:
        spans = tracing.request_spans()
        spans.start("r1", "decode", parent={"traceparent": CLIENT_TRACEPARENT}, attributes={"tandem.request_id": "r1"})
        spans.start("r1", "decode.queue", parent="decode")
        received = SimpleNamespace(ok=True, error=None, num_bytes=4096, transport="shm", seconds=0.002)
        spans.transfer("r1", "kv_transfer.receive", "decode", received, ends="decode.queue", num_blocks=2)
        for _ in range(3):  # one token per step; the first ends nothing more (the queue is over)
            spans.switch("r1", ("decode.queue",), "decode.decoding", parent="decode")
            spans.count("r1", "decode.decoding", "tandem.num_output_tokens", 1)
        spans.start("r2", "decode")  # a request the worker lets go of without an end of its own
        spans.retain({"r1"})
        spans.end_all("r1", {"tandem.finish_reason": "length"})
        assert len(spans) == 0
        by_name = {s.name: s for s in log.spans()}
    decode = by_name["decode"]
    for name in ("decode.queue", "kv_transfer.receive", "decode.decoding"):
        assert by_name[name].parent.span_id == decode.context.span_id, name
    assert format(decode.context.trace_id, "032x") == CLIENT_TRACE_ID
    assert decode.attributes["tandem.finish_reason"] == "length"
    assert by_name["decode.decoding"].attributes["tandem.num_output_tokens"] == 3
    transfer = by_name["kv_transfer.receive"]
    assert transfer.attributes["tandem.kv.num_bytes"] == 4096 and transfer.attributes["tandem.kv.num_blocks"] == 2
    assert transfer.end_time - transfer.start_time == 2_000_000
    assert by_name["decode.queue"].end_time == transfer.start_time  # the queue ended as the transfer began
    assert by_name["decode.decoding"].start_time >= transfer.end_time


def test_retain_ends_the_spans_of_requests_the_worker_let_go():
    with in_memory_tracing() as log:
        spans = tracing.request_spans()
        spans.start("kept", "prefill")
        spans.start("gone", "prefill")
        spans.start("gone", "prefill.queue", parent="prefill")
        spans.retain({"kept"})
        ended = {s.name for s in log.spans()}
        assert ended == {"prefill", "prefill.queue"} and len(spans) == 1
        spans.end_all("kept")


def test_shutdown_sends_the_batched_spans_over_otlp_http():
    from bench.otlp_receiver import OtlpReceiver

    with OtlpReceiver() as receiver:
        assert tracing.configure(receiver.endpoint, "tandem-decode", "decode-3")
        try:
            for i in range(20):
                tracing.start_span(f"s{i}").end()
            assert receiver.spans == []  # batched: the SDK's 5 s delay has not passed
        finally:
            tracing.shutdown()
        assert sorted(s.name for s in receiver.spans) == sorted(f"s{i}" for i in range(20))
        assert {(s.service, s.worker_id) for s in receiver.spans} == {("tandem-decode", "decode-3")}


def test_a_collector_that_is_down_does_not_hold_up_a_stopping_process():
    import time

    from pipeline.tracing.otlp import SHUTDOWN_FLUSH_S

    assert tracing.configure("http://127.0.0.1:9", "tandem-router")  # nothing listens on the discard port
    tracing.start_span("lost").end()
    started = time.monotonic()
    tracing.shutdown()  # the exporter alone would retry for about 10 s
    assert time.monotonic() - started < SHUTDOWN_FLUSH_S + 1.5
