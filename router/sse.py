"""Server-sent events: one JSON payload per event, framed so that every reader splits it back whole.

JSON allows U+0085 (NEL), U+2028 and U+2029 raw inside strings, but readers that split a stream into
lines the way Python's ``str.splitlines`` does (httpx's ``aiter_lines``, which many hand-written SSE
clients use) treat them as line ends and cut the event in two. Escaped (``\\u2028``) they are the
same JSON for every compliant parser, and the event stays on one line.
"""

from __future__ import annotations

from typing import Any

import msgspec

_json = msgspec.json.Encoder()

# UTF-8 of each separator -> its JSON escape. In valid UTF-8 these byte runs only ever encode those
# characters, and outside strings JSON has none of them, so a byte replace is exact.
_LINE_SEPARATORS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def json_for_sse(payload: Any) -> bytes:
    """``payload`` as compact JSON with no character a line-splitting reader would break at."""
    data = _json.encode(payload)
    for raw, escaped in _LINE_SEPARATORS:
        if raw in data:
            data = data.replace(raw, escaped)
    return data


def sse_event(payload: Any, event: str | None = None) -> bytes:
    """One SSE event: ``[event: NAME\\n]data: JSON\\n\\n``."""
    head = b"event: " + event.encode() + b"\n" if event is not None else b""
    return head + b"data: " + json_for_sse(payload) + b"\n\n"
