"""``RequestSpans``: a worker's open spans, by request id and span name, for spans that begin and end in
different passes of its loop (queued on arrival, computing at the first chunk, done after the transfer).

Each request's first span (started with a wire carrier or None as parent) is its root on this worker;
later ones name an open span of the same request as parent. ``end_all`` closes what is open (children
first), so a request that ends any way at all leaves nothing behind; ``retain`` does it for requests a
worker no longer holds."""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from typing import Any


class RequestSpans:
    def __init__(self, backend) -> None:
        self._backend = backend
        self._open: dict[str, dict[str, Any]] = {}  # request id -> span name -> span, in start order
        self._counts: dict[tuple[str, str], dict[str, int]] = {}  # (request id, span name) -> counters

    def __len__(self) -> int:
        return len(self._open)

    def start(self, request_id: str, name: str, parent: Any = None, attributes: Mapping[str, Any] | None = None,
              start_ns: int | None = None) -> None:
        spans = self._open.setdefault(request_id, {})
        if name in spans:
            return
        spans[name] = self._backend.start_span(name, self._parent(request_id, parent), attributes, start_ns)

    def set(self, request_id: str, name: str, attributes: Mapping[str, Any]) -> None:
        span = self._open.get(request_id, {}).get(name)
        if span is not None:
            span.set_attributes(attributes)

    def switch(self, request_id: str, ended: tuple[str, ...], started: str, parent: Any = None,
               at_ns: int | None = None) -> None:
        """End the ``ended`` spans that are open and start ``started`` unless it is open already: one stage
        of the request gives way to the next (the first token ends the queue and starts decoding); ``at_ns``:
        when that happened, if not now (the start of the step that is over by the time it is known)."""
        spans = self._open.get(request_id)
        if spans is None or started in spans:
            return
        for name in ended:
            self.end(request_id, name, end_ns=at_ns)
        self.start(request_id, started, parent, start_ns=at_ns)

    def count(self, request_id: str, name: str, key: str, amount: int = 1) -> None:
        """Add ``amount`` to the counter ``key``, set on span ``name`` when it ends (tokens, steps)."""
        if name in self._open.get(request_id, ()):
            counts = self._counts.setdefault((request_id, name), {})
            counts[key] = counts.get(key, 0) + amount

    def end(self, request_id: str, name: str, attributes: Mapping[str, Any] | None = None,
            end_ns: int | None = None) -> None:
        spans = self._open.get(request_id)
        span = spans.pop(name, None) if spans is not None else None
        if span is None:
            return
        counts = self._counts.pop((request_id, name), None)
        if counts:
            span.set_attributes(counts)
        if attributes:
            span.set_attributes(attributes)
        span.end(end_time=end_ns)
        if not spans:
            del self._open[request_id]

    def record(self, request_id: str, name: str, parent: Any, start_ns: int, end_ns: int | None = None,
               attributes: Mapping[str, Any] | None = None) -> None:
        """A span that is over already (its times measured elsewhere, e.g. by the transfer service)."""
        span = self._backend.start_span(name, self._parent(request_id, parent), attributes, start_ns)
        span.end(end_time=end_ns if end_ns is not None else time.time_ns())

    def transfer(self, request_id: str, name: str, parent: str, result: Any, ends: str | None = None,
                 num_blocks: int | None = None) -> None:
        """A finished KV transfer as span ``name``: ``result`` is the transfer service's verdict (``SendStatus``
        or ``ReceivedTransfer``: ok, bytes, transport, seconds), the span ending now and lasting its seconds.
        ``ends``: an open span of the request that gave way to the transfer when it began (the queue)."""
        end_ns = time.time_ns()
        start_ns = end_ns - int(result.seconds * 1e9)
        if ends is not None:
            self.end(request_id, ends, end_ns=start_ns)
        attributes = {"tandem.kv.num_bytes": result.num_bytes, "tandem.kv.transport": result.transport,
                      "tandem.kv.ok": result.ok, "tandem.kv.seconds": result.seconds}
        if num_blocks is not None:
            attributes["tandem.kv.num_blocks"] = num_blocks
        if result.error:
            attributes["tandem.kv.error"] = result.error
        self.record(request_id, name, parent, start_ns, end_ns, attributes)

    def end_all(self, request_id: str, attributes: Mapping[str, Any] | None = None) -> None:
        """End every open span of the request, the latest started first; ``attributes`` go on its root."""
        spans = self._open.get(request_id)
        if not spans:
            return
        names = list(spans)
        for name in reversed(names):
            self.end(request_id, name, attributes if name == names[0] else None)

    def retain(self, request_ids: Collection[str]) -> None:
        """End the spans of every request not in ``request_ids`` (those the worker let go of)."""
        for request_id in [r for r in self._open if r not in request_ids]:
            self.end_all(request_id, {"tandem.ended_without_result": True})

    def _parent(self, request_id: str, parent: Any) -> Any:
        if isinstance(parent, str):  # another open span of this request
            return self._open.get(request_id, {}).get(parent)
        return parent
