"""A tiny OTLP/HTTP trace receiver, the tracing benchmark's collector and the tracing tests': POST
/v1/traces with a protobuf ExportTraceServiceRequest (decoded with opentelemetry-proto), every span kept
as a ``ReceivedSpan``."""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)


@dataclass
class ReceivedSpan:
    service: str  # the resource's service.name
    worker_id: str | None  # the resource's tandem.worker_id
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root
    start_ns: int
    end_ns: int
    attributes: dict


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind is not None else None


def _attributes(key_values) -> dict:
    return {kv.key: _value(kv.value) for kv in key_values}


class OtlpReceiver:
    """``with OtlpReceiver() as receiver``: ``receiver.endpoint`` (http://127.0.0.1:PORT), ``spans``."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.num_posts = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._collect(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="otlp-receiver")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _collect(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(ReceivedSpan(
                        service=resource.get("service.name", ""), worker_id=resource.get("tandem.worker_id"),
                        name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(), start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano, attributes=_attributes(span.attributes)))
        with self._lock:
            self.num_posts += 1
            self.spans.extend(spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 10.0) -> list[ReceivedSpan]:
        """The trace's spans once every one of ``names`` arrived (or whatever came by the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            if names <= {s.name for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)

    def __enter__(self) -> "OtlpReceiver":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
