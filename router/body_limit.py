"""A bound on request bodies, checked before the body is parsed: 413 in OpenAI's error shape.

FastAPI reads and validates a JSON body on the event loop, and every stream in flight shares that loop; a body
of tens of MiB would stall them all while it is parsed (and then tokenized). A declared ``Content-Length`` over the
bound is refused at once; a body sent without one (chunked) is read here up to the bound, refused once it passes
it, and otherwise handed on whole.
"""

from __future__ import annotations

from router.errors import APIError


class BodyLimitMiddleware:
    """Pure ASGI middleware: HTTP requests with a body over ``max_mib`` MiB get 413; everything else passes."""

    def __init__(self, app, max_mib: float) -> None:
        self.app = app
        self.max_mib = max_mib
        self.max_bytes = int(max_mib * 2**20)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.max_bytes:
                await self._refuse(scope, receive, send)
            else:
                await self.app(scope, receive, send)  # the server reads no more than it declared
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send) -> None:
        error = APIError(413, f"the request body is larger than this server accepts ({self.max_mib:g} MiB, "
                              f"router.max_request_body_mib)", code="request_too_large")
        await error.response()(scope, receive, send)
