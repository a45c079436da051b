"""``RequestTrace``: one request's spans at the router, and the trace context its workers' spans join.

``tandem.request`` spans the request's life here (a child of the client's ``traceparent``, else a new
trace); beneath it ``router.queue`` (submitted until admitted to a worker slot), one ``router.route`` per
attempt (the chosen workers, the prompt's cached blocks on each, the policy's cost) and
``router.migration`` (a stream's move after its worker died, failed it or drained, until its next token
arrives: the pause the client sees). Every ``GenerateRequest`` / ``StartPrefill`` carries ``context`` (the
request span's W3C context), so the prefill and decode workers' spans are its children. A request that
fails (429, 503, a timeout, an error) ends its span with ERROR status; one refused before it became a request
(a bad body, an API key, a prompt past the context: ``trace_rejection``) gets a ``tandem.request`` span of
its own, also an ERROR, under the client's ``traceparent`` as well. With tracing off ``request_trace``
returns ``NO_TRACE``, whose methods do nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline import tracing
from router.policy import Route, route_costs


class RequestTrace:
    def __init__(self, request_id: str, num_prompt_tokens: int, max_tokens: int | None, priority: int,
                 client_context: Mapping[str, str] | None) -> None:
        attributes = {"tandem.request_id": request_id, "tandem.num_prompt_tokens": num_prompt_tokens,
                      "tandem.priority": priority}
        if max_tokens is not None:
            attributes["tandem.max_tokens"] = max_tokens
        self.span = tracing.start_span("tandem.request", parent=client_context, attributes=attributes,
                                       is_server=True)
        self.context = tracing.inject(self.span)
        self._queue = tracing.start_span("router.queue", parent=self.span)
        self._migration = None

    def admitted(self) -> None:
        if self._queue is not None:
            self._queue.end()
            self._queue = None

    def routed(self, route: Route, wire_id: str, attempt: int, num_prompt_tokens: int,
               kv_overlap_weight: float | None) -> None:
        attributes: dict[str, Any] = {"tandem.wire_id": wire_id, "tandem.attempt": attempt,
                                      "tandem.decode_worker": route.decode.worker_id,
                                      "tandem.local_prefill": route.prefill is None}
        if route.prefill is not None:
            attributes["tandem.prefill_worker"] = route.prefill.worker_id
        attributes |= route_costs(route, num_prompt_tokens, kv_overlap_weight)
        if self._migration is not None:  # a moved stream is on its way again: paused until its next token
            self._migration.set_attribute("tandem.migration.to_worker", route.decode.worker_id)
        tracing.start_span("router.route", parent=self.span, attributes=attributes).end()

    def migrating(self, cause: str, from_worker: str, num_output_tokens: int) -> None:
        """The stream moves (a dead or failing worker: replayed; a drain: with its KV) after ``num_output_tokens``."""
        self.migrated()
        self._migration = tracing.start_span("router.migration", parent=self.span, attributes={
            "tandem.migration.cause": cause, "tandem.migration.from_worker": from_worker,
            "tandem.migration.num_output_tokens": num_output_tokens})

    def handed_off(self, to_worker: str) -> None:
        """A draining worker's stream was sent, with its KV, to ``to_worker``."""
        if self._migration is not None:
            self._migration.set_attribute("tandem.migration.to_worker", to_worker)

    def migrated(self) -> None:
        """The stream's pause is over: its first token after the move came (or the move was called off)."""
        if self._migration is not None:
            self._migration.end()
            self._migration = None

    def finished(self, outcome: str, num_output_tokens: int, error: str | None = None) -> None:
        """The request is over: ``outcome`` (``finished``, ``cancelled``, ``timeout``, ``failed (503)``, ...);
        ``error``: what failed it, which marks the span as an error."""
        self.admitted()
        self.migrated()
        self.span.set_attributes({"tandem.outcome": outcome, "tandem.num_output_tokens": num_output_tokens})
        if error is not None:
            tracing.mark_error(self.span, error)
        self.span.end()



class _NoTrace:
    """``RequestTrace`` with tracing off: no spans, no context on the wire."""

    __slots__ = ()
    context = None

    def admitted(self) -> None:
        pass

    def routed(self, route, wire_id, attempt, num_prompt_tokens, kv_overlap_weight) -> None:
        pass

    def migrating(self, cause, from_worker, num_output_tokens) -> None:
        pass

    def handed_off(self, to_worker) -> None:
        pass

    def migrated(self) -> None:
        pass

    def finished(self, outcome, num_output_tokens, error=None) -> None:
        pass


NO_TRACE = _NoTrace()


def request_trace(request_id: str, num_prompt_tokens: int, max_tokens: int | None, priority: int,
                  client_context: Mapping[str, str] | None):
    """The request's ``RequestTrace``, or ``NO_TRACE`` when tracing is off."""
    if not tracing.is_enabled():
        return NO_TRACE
    return RequestTrace(request_id, num_prompt_tokens, max_tokens, priority, client_context)


REQUEST_TRACED = "tandem_request_traced"  # set in an HTTP request's ASGI state once a RequestTrace covers it


def trace_rejection(status: int, scope: Mapping[str, Any], arrived_ns: int) -> None:
    """A generation request refused with ``status`` before a ``RequestTrace`` covered it: its one span, from
    arrival to the refusal, under the client's ``traceparent`` (nothing when tracing is off)."""
    if not tracing.is_enabled() or scope.get("state", {}).get(REQUEST_TRACED):
        return
    carrier = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope.get("headers", ())
               if name in (b"traceparent", b"tracestate")}
    attributes = {"http.route": scope.get("path", ""), "tandem.outcome": f"rejected ({status})"}
    span = tracing.start_span("tandem.request", parent=carrier or None, attributes=attributes, start_ns=arrived_ns,
                              is_server=True)
    tracing.mark_error(span, f"refused with HTTP {status}")
    span.end()
