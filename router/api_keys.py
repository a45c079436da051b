"""The router's API keys (``--api-key``), checked before anything of the request is read: 401 in OpenAI's error
shape with ``WWW-Authenticate: Bearer``, as vLLM's middleware answers, even for a body that is not JSON (checked
in a route's dependency, the key came after the body's parse, and a malformed body got 400 without any key).

The OpenAI paths (``/v1/...``) and vLLM's tokenizer endpoints are guarded; ``/health``, ``/ready`` and
``/metrics`` stay open (probes and Prometheus); a CORS preflight (OPTIONS) is answered outside this check.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from router.errors import APIError

GUARDED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")
GUARDED_PREFIX = "/v1/"


def is_guarded(path: str) -> bool:
    return path.startswith(GUARDED_PREFIX) or path in GUARDED_PATHS


def key_matches(authorization: str, api_keys: Sequence[str]) -> bool:
    """Whether an ``Authorization`` header value carries one of ``api_keys`` as a bearer token; every key is
    compared in constant time, with no early way out."""
    scheme, _, token = authorization.partition(" ")
    given = token.strip().encode()
    matches = [hmac.compare_digest(given, key.encode()) for key in api_keys]
    return scheme.lower() == "bearer" and any(matches)


class ApiKeyCheck:
    """Pure ASGI middleware: a guarded path without one of ``api_keys`` gets 401; everything else passes."""

    def __init__(self, app, api_keys: Sequence[str]) -> None:
        self.app = app
        self.api_keys = list(api_keys)

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or not self.api_keys or scope["method"] == "OPTIONS"
                or not is_guarded(scope["path"])):
            await self.app(scope, receive, send)
            return
        authorization = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
        if key_matches(authorization, self.api_keys):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "Invalid or missing API key (send 'Authorization: Bearer <key>').",
                         code="invalid_api_key")
        await error.response()(scope, receive, send)
