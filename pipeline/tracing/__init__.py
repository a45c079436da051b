"""OpenTelemetry tracing behind a tiny facade: one trace per request across router, prefill, KV transfer
and decode (docs/observability.md, "Traces").

``configure(endpoint, service_name, worker_id)`` runs once per process (the router's and the workers'
entry points, from ``PipelineConfig.otlp_traces_endpoint``). Without an endpoint nothing is imported and
every call below returns a shared no-op object: ``start_span`` gives ``NOOP_SPAN``, ``inject`` None,
``request_spans`` ``NOOP_REQUEST_SPANS``. Callers never branch on whether tracing is on.

Parents: a span from ``start_span``, a W3C trace-context carrier (``inject``'s dict, a message's
``trace_context``, an HTTP request's headers: read by the SDK's propagator), or None for a new trace.
Times are wall-clock nanoseconds (``time.time_ns()``), as OpenTelemetry records them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.tracing.noop import NOOP_REQUEST_SPANS, NOOP_SPAN, NoopRequestSpans, NoopSpan

_backend = None  # pipeline.tracing.otlp.OtlpTracing once configured with an endpoint


def configure(endpoint: str | None, service_name: str, worker_id: str | None = None) -> bool:
    """Export this process's spans to the OTLP/HTTP ``endpoint`` (a collector's base URL, or its
    ``/v1/traces`` URL) as ``service_name``; no endpoint: tracing stays off. True when on."""
    global _backend
    if not endpoint:
        return False
    if _backend is None:
        try:
            from pipeline.tracing.otlp import OtlpTracing
        except ImportError as exc:
            raise RuntimeError(f"otlp_traces_endpoint needs the OpenTelemetry SDK and OTLP/HTTP exporter "
                               f"(pip install 'tandem[tracing]'): {exc}") from exc
        _backend = OtlpTracing(endpoint, service_name, worker_id)
    return True


def shutdown() -> None:
    """Flush the spans still batched and stop the exporter (a process's way out)."""
    global _backend
    backend, _backend = _backend, None
    if backend is not None:
        backend.shutdown()


def is_enabled() -> bool:
    return _backend is not None


def start_span(name: str, parent: Any = None, attributes: Mapping[str, Any] | None = None,
               start_ns: int | None = None, is_server: bool = False):
    """A started span (end it with ``.end()``), a child of ``parent``; ``NOOP_SPAN`` when tracing is off.
    ``is_server``: the span of a request this process serves for a client (OpenTelemetry's SERVER kind)."""
    if _backend is None:
        return NOOP_SPAN
    return _backend.start_span(name, parent, attributes, start_ns, is_server)


def mark_error(span, description: str) -> None:
    """Give ``span`` OpenTelemetry's ERROR status with ``description`` (what failed)."""
    if _backend is not None and span is not NOOP_SPAN:
        _backend.mark_error(span, description)


def inject(span) -> dict[str, str] | None:
    """``span``'s W3C trace context (``traceparent``, ``tracestate``) for a wire message; None when off."""
    if _backend is None or span is NOOP_SPAN:
        return None
    return _backend.inject(span)


def request_spans():
    """Open spans keyed by request id, for a worker's loop (``RequestSpans``); a no-op when off."""
    if _backend is None:
        return NOOP_REQUEST_SPANS
    from pipeline.tracing.keyed_spans import RequestSpans

    return RequestSpans(_backend)


__all__ = ["configure", "shutdown", "is_enabled", "start_span", "mark_error", "inject", "request_spans",
           "NOOP_SPAN", "NOOP_REQUEST_SPANS", "NoopSpan", "NoopRequestSpans"]
