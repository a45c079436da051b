"""Counting the generation requests refused with a 4xx, wherever they were refused.

A completion, chat or Responses request can be turned away by the API key check (401), the body limit (413),
FastAPI's validation or a wrong method (400, 405), the model name (404) or the prompt (400): each is counted
once, as ``tandem_requests_total{outcome="rejected"}``, by the status its response starts with. 429 is
``overloaded`` and 499 (the client left while it waited) ``cancelled``, both counted where they happen; other
endpoints (``/tokenize``, ``/v1/models``, an unknown path) are not generation requests and are not counted.
The owner's ``on_rejected`` also gets the request's scope and arrival time: a refusal has its trace too
(``request_trace.trace_rejection``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

COUNTED_ELSEWHERE = (429, 499)


class RejectionCounter:
    """Pure ASGI middleware (outermost, so that every refusal passes it); streams pass untouched."""

    def __init__(self, app, on_rejected: Callable[[int, dict, int], None], paths: Collection[str]) -> None:
        """``on_rejected(status, scope, arrived_ns)``: once per refused request (arrival in ``time.time_ns()``)."""
        self.app = app
        self.on_rejected = on_rejected
        self.paths = frozenset(paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths or scope["method"] == "OPTIONS":  # CORS
            await self.app(scope, receive, send)
            return
        arrived_ns = time.time_ns()

        async def watching_send(message):
            if message["type"] == "http.response.start":
                status = message["status"]
                if 400 <= status < 500 and status not in COUNTED_ELSEWHERE:
                    self.on_rejected(status, scope, arrived_ns)
            await send(message)

        await self.app(scope, receive, watching_send)
