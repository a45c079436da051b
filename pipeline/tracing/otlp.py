"""The OpenTelemetry SDK behind ``pipeline.tracing``: a tracer provider for this process (its role's
``service.name``, the worker id as ``service.instance.id`` and ``tandem.worker_id``), a BatchSpanProcessor
and the OTLP/HTTP exporter. Imported only when an endpoint is configured."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

TRACES_PATH = "/v1/traces"
SHUTDOWN_FLUSH_S = 2.0  # how long a stopping process waits for its last spans to reach the collector


def traces_url(endpoint: str) -> str:
    """A collector's base URL gets OTLP/HTTP's traces path, as ``OTEL_EXPORTER_OTLP_ENDPOINT`` does, a path
    prefix included (``http://host:4318``, a gateway's ``https://host/otlp``); a URL that ends in it is kept."""
    endpoint = endpoint.rstrip("/")
    return endpoint if urlsplit(endpoint).path.endswith(TRACES_PATH) else endpoint + TRACES_PATH


class OtlpTracing:
    def __init__(self, endpoint: str, service_name: str, worker_id: str | None = None, exporter=None) -> None:
        """``exporter``: where spans go instead of OTLP/HTTP (tests)."""
        attributes = {"service.name": service_name}
        if worker_id:
            attributes |= {"service.instance.id": worker_id, "tandem.worker_id": worker_id}
        # shut down by ``shutdown`` (bounded), not by the SDK's unbounded one at interpreter exit
        self.provider = TracerProvider(resource=Resource.create(attributes), shutdown_on_exit=False)
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=traces_url(endpoint))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("tandem")

    def start_span(self, name: str, parent: Any, attributes: Mapping[str, Any] | None, start_ns: int | None,
                   is_server: bool = False):
        kind = trace.SpanKind.SERVER if is_server else trace.SpanKind.INTERNAL
        return self.tracer.start_span(name, context=_context(parent), kind=kind, attributes=attributes,
                                      start_time=start_ns)

    @staticmethod
    def mark_error(span, description: str) -> None:
        span.set_status(trace.Status(trace.StatusCode.ERROR, description))

    def inject(self, span) -> dict[str, str]:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span, Context()))
        return carrier

    def shutdown(self, flush_timeout_s: float = SHUTDOWN_FLUSH_S) -> None:
        """Send the spans still batched, waiting at most ``flush_timeout_s``: a collector that is down must
        not hold up a process's exit (the exporter retries for up to 10 s). Spans not out by then are lost."""
        stopping = threading.Thread(target=self.provider.shutdown, name="tracing-shutdown", daemon=True)
        stopping.start()
        stopping.join(flush_timeout_s)


def _context(parent: Any) -> Context:
    """The context a new span starts in: under a span, under a W3C carrier (the propagator reads it), or
    empty (a new trace; never the ambient context, which no Tandem code sets)."""
    if parent is None:
        return Context()
    if isinstance(parent, trace.Span):
        return trace.set_span_in_context(parent, Context())
    return propagate.extract(parent, context=Context())
