"""Tracing switched on in this process with spans kept in memory (no collector): ``in_memory_tracing``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pipeline import tracing
from pipeline.tracing.otlp import OtlpTracing


@contextlib.contextmanager
def in_memory_tracing(service_name: str = "tandem-test", worker_id: str = "w0") -> Iterator["SpanLog"]:
    """Tracing on for the body (as ``configure`` would turn it on); ``log.spans()`` flushes and returns the
    finished spans. Off again afterwards."""
    assert not tracing.is_enabled(), "tracing was left on by an earlier test"
    exporter = InMemorySpanExporter()
    backend = OtlpTracing("http://127.0.0.1:9/unused", service_name, worker_id, exporter=exporter)
    tracing._backend = backend
    try:
        yield SpanLog(backend, exporter)
    finally:
        tracing.shutdown()


class SpanLog:
    def __init__(self, backend: OtlpTracing, exporter: InMemorySpanExporter) -> None:
        self._backend, self._exporter = backend, exporter

    def spans(self) -> list:
        self._backend.provider.force_flush()
        return list(self._exporter.get_finished_spans())

    def named(self, name: str) -> list:
        return [s for s in self.spans() if s.name == name]
