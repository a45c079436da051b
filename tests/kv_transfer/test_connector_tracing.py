"""KV moves in a request's trace: the sink half's PrefillRequest carries the GenerateRequest's
``trace_context`` (the prefill worker's spans join the request's trace), the event of an arrival carries
the receiver's verdict (bytes, transport, seconds) for the decode worker's transfer span, and a draining
decode worker's handoff of a stream becomes a send span under the stream's ``decode`` span."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec

from decode_worker.kv_handoff import KVHandoff
from kv_transfer.connector.sink import KVSink
from kv_transfer.interface import SendStatus
from pipeline import tracing
from tests.tracing_support import in_memory_tracing
from tests.kv_transfer.test_connector import FakeEngine
from tests.kv_transfer.test_connector_sink import FakeLinks, FakeReceiver, done, generate, reserve

CONTEXT = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


def test_the_prefill_request_carries_the_trace_context_and_the_arrival_its_transfer():
    sink = KVSink(FakeReceiver(), FakeLinks(), FakeEngine(), "d0", ttl_s=5.0)
    sink.expect(msgspec.structs.replace(generate(), trace_context=CONTEXT))
    reserve(sink)
    ((_, request),) = sink.links.sent
    assert request.trace_context == CONTEXT
    arrival = done(num_bytes=2048)
    sink.receiver.results.append(arrival)
    (event,) = sink.progress(101.0)
    assert event.first_step is not None and event.received is arrival


def test_an_untraced_request_asks_without_context():
    sink = KVSink(FakeReceiver(), FakeLinks(), FakeEngine(), "d0", ttl_s=5.0)
    sink.expect(generate())
    reserve(sink)
    ((_, request),) = sink.links.sent
    assert request.trace_context is None


def test_a_handed_off_stream_sends_its_kv_under_its_decode_span():
    sent = SendStatus("target-id", ok=True, num_bytes=8192, transport="zmq", seconds=0.003)
    transfer = SimpleNamespace(request_id="s1", num_sent_blocks=5, num_skipped_blocks=1, status=None)
    source = SimpleNamespace(receive=lambda: [], reap=lambda: [(transfer, sent)])
    with in_memory_tracing("tandem-decode", "decode-0") as log:
        spans = tracing.request_spans()
        spans.start("s1", "decode", parent=CONTEXT)
        handoff = KVHandoff("decode-0", engine=None, open_source=lambda: source, spans=spans)
        handoff.source = source
        assert handoff.progress() == ["s1"]
        spans.end_all("s1")  # the worker forgets the stream that left
        by_name = {s.name: s for s in log.spans()}
    send, decode = by_name["kv_transfer.send"], by_name["decode"]
    assert send.parent.span_id == decode.context.span_id
    assert send.attributes["tandem.kv.num_bytes"] == 8192 and send.attributes["tandem.kv.num_blocks"] == 4
    assert send.attributes["tandem.kv.transport"] == "zmq"
