"""OpenAI-style errors: one exception type, one JSON body, and the FastAPI handlers that produce it.

Body: ``{"error": {"message": str, "type": str, "param": str | None, "code": str | int | None}}``.
FastAPI's own 422 validation errors and Starlette's 404/405 are rewritten into the same body
(422 becomes 400, as OpenAI answers). An overloaded router answers 429 with ``Retry-After`` and
``code: "rate_limit_exceeded"``, as OpenAI does, so clients (the openai SDK among them) back off and retry.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error the client sees with ``status_code`` and an OpenAI error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        # a message may quote what the client sent, and JSON bodies are UTF-8: a lone surrogate (valid in a JSON
        # string's escapes, not in UTF-8) is quoted as its escape
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status_code, "api_error")
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        if status_code == 401:
            self.headers.setdefault("WWW-Authenticate", "Bearer")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers or None)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def overloaded(message: str, retry_after_s: int) -> APIError:
    """429: every worker is busy and the request cannot wait in the router (queue full or waited too long)."""
    return APIError(429, message, code="rate_limit_exceeded", headers={"Retry-After": str(max(1, int(retry_after_s)))})


def from_value_error(exc: ValueError) -> APIError:
    """A ``"field: rule (got x)"`` ValueError (SamplingParams, our own checks) -> 400 naming the field."""
    message = str(exc)
    param = message.split(":", 1)[0] if ":" in message else None
    if param is not None and (" " in param or not param):
        param = None
    return APIError(400, message, param=param)


_UNSUPPORTED_HINTS = {  # fields OpenAI clients send that this server does not support: what to do instead
    "functions": "the deprecated function-calling field is not supported; send tools",
    "function_call": "the deprecated function-calling field is not supported; send tool_choice",
    "reasoning_effort": "not supported; a thinking model's template options go in chat_template_kwargs "
                        "(e.g. {\"enable_thinking\": false})",
    "suffix": "not supported",
}

_UNION_HINTS = {
    "prompt": "must be a string, a list of token ids, or a list holding one string or one list of token ids",
    "stop": "must be a string or a list of strings",
}


def _format_validation_errors(exc: RequestValidationError) -> tuple[str, str | None]:
    by_param: dict[str | None, list[dict]] = {}
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return f"Invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        # pydantic adds the union member it tried ("str", "list[int]") to the path: keep field names only
        loc = [p for p in loc if not (p[:1].islower() and ("[" in p or p in _TYPE_WORDS)) and not p.startswith("item:")]
        by_param.setdefault(".".join(loc) or None, []).append(err)
    if not by_param:
        return "invalid request", None
    # A union's branches fail at different depths ("input" is not a string; "input.0.output.0.type" is wrong in
    # the list it is): the deepest say what is wrong, so a place another error lies below is left out (except
    # where a hint says what the union accepts)
    nested = [p for p in by_param if p is not None and p.split(".")[-1] not in _UNION_HINTS
              and any(q is not None and q.startswith(p + ".") for q in by_param)]
    for param in nested:
        del by_param[param]
    parts = []
    for param, errs in list(by_param.items())[:5]:
        err = errs[0]
        if param is None:
            parts.append("the request body must be a JSON object" if err.get("type") in ("missing", "model_attributes_type")
                         else err.get("msg", "invalid request"))
            continue
        msg = err.get("msg", "invalid value").removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":  # accepted means honoured: an unknown field is refused by name
            parts.append(f"{param}: {_UNSUPPORTED_HINTS.get(param.split('.')[-1], 'is not supported by this server')}")
            continue
        if len(errs) > 1:  # one error per union member: say what is accepted instead
            msg = _UNION_HINTS.get(param.split(".")[-1], "has an invalid type")
        text = f"{param}: {msg}"
        value = err.get("input")
        if err.get("type") != "missing" and "(got " not in text and not isinstance(value, (dict, list)):
            text += f" (got {value!r})"
        parts.append(text)
    if len(by_param) > 5:
        parts.append(f"... {len(by_param) - 5} more")
    return "; ".join(parts), next(iter(by_param))


_TYPE_WORDS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


def install_error_handlers(app: FastAPI, on_error: Callable[[], None] | None = None) -> None:
    """Route every error through the OpenAI body; ``on_error`` is called for each unexpected exception (a 500)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _format_validation_errors(exc)
        content_type = request.headers.get("content-type", "")
        if request.method == "POST" and "json" not in content_type.lower():  # e.g. curl -d without -H
            message = (f"the request body must be JSON sent with 'Content-Type: application/json' "
                       f"(got {content_type or 'no Content-Type'!r})")
            param = None
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return APIError(exc.status_code, message).response()

    app.add_middleware(UnexpectedErrorMiddleware, on_error=on_error)


class UnexpectedErrorMiddleware:
    """A bug's exception becomes a 500 in the OpenAI shape, logged and counted, and the connection stays usable.

    (Starlette's own handler for ``Exception`` answers too, but then raises the exception on to the server, which
    drops the client's keep-alive connection: its next request on it fails.) Pure ASGI, so streams pass untouched;
    an exception after a response started can only end that response."""

    def __init__(self, app, on_error: Callable[[], None] | None = None) -> None:
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.exception("unhandled error in the router")
            if started:
                raise
            if self.on_error is not None:
                self.on_error()
            await APIError(500, f"internal error: {type(exc).__name__}").response()(scope, receive, send)
