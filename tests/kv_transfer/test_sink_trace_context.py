"""The sink half passes the request's trace on: its PrefillRequest carries the GenerateRequest's
``trace_context`` (the prefill worker's spans join the request's trace), and the event of an arrival
carries the receiver's verdict (bytes, transport, seconds) for the decode worker's transfer span."""

from __future__ import annotations

import msgspec

from kv_transfer.connector.sink import KVSink
from tests.kv_transfer.test_connector import FakeEngine, FakeLinks, FakeReceiver, done, generate, reserve

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
