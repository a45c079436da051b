"""The benchmark's streaming client: sends each request at its arrival time and times every chunk.

One asyncio task per request over one ``httpx.AsyncClient`` (no connection limit, so arrivals are
never held back by the client; ``max_concurrency`` caps requests in flight when asked, as vLLM's
``--max-concurrency``). Times come from ``time.perf_counter`` (monotonic). Output tokens are the
server's ``usage.completion_tokens`` (``stream_options.include_usage``), or the tokenizer's count of
the text when the server sends no usage.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

from bench.serve_workload import CHAT_ENDPOINT, BenchRequest


@dataclass
class RequestOutcome:
    request: BenchRequest
    is_success: bool = False
    error: str | None = None
    status_code: int | None = None  # HTTP status when the request failed before streaming
    start_s: float = 0.0  # when it was sent, from the start of the run
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between token chunks (text or finish reason)
    e2el_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None  # as the server reported it

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's definition)."""
        if self.ttft_s is None or self.e2el_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class ClientSettings:
    base_url: str
    endpoint: str
    model: str
    api_key: str | None = None
    ignore_eos: bool = False
    max_concurrency: int | None = None
    timeout_s: float = 600.0


def request_body(settings: ClientSettings, request: BenchRequest) -> dict:
    body: dict = {"model": settings.model, "max_tokens": request.output_len, "temperature": 0.0,
                  "stream": True, "stream_options": {"include_usage": True}}
    if settings.endpoint == CHAT_ENDPOINT:
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if settings.ignore_eos:
        body["ignore_eos"] = True
    return body


def chunk_text(chunk: dict) -> tuple[str, bool]:
    """(the chunk's text, whether it finishes the choice)."""
    choices = chunk.get("choices") or []
    if not choices:
        return "", False
    choice = choices[0]
    text = choice["delta"].get("content") if "delta" in choice else choice.get("text")
    return text or "", choice.get("finish_reason") is not None


async def sse_lines(response: httpx.Response):
    """The stream's lines, split on newlines only (``aiter_lines`` also splits on characters such as
    U+2028 or U+0085, which may appear unescaped inside a JSON string of generated text)."""
    pending = b""
    async for data in response.aiter_bytes():
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if pending:
        yield pending


async def send_one(client: httpx.AsyncClient, settings: ClientSettings, outcome: RequestOutcome,
                   run_start: float, count_tokens: Callable[[str], int]) -> None:
    sent = time.perf_counter()
    outcome.start_s = sent - run_start
    last = sent
    text, usage = [], None
    try:
        async with client.stream("POST", settings.base_url + settings.endpoint,
                                 json=request_body(settings, outcome.request)) as response:
            if response.status_code != 200:
                outcome.status_code = response.status_code
                outcome.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:300]}"
                return
            async for line in sse_lines(response):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    outcome.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return
                usage = chunk.get("usage") or usage
                piece, is_last = chunk_text(chunk)
                if piece or is_last:  # a token arrived (its text may be empty: e.g. a special token)
                    now = time.perf_counter()
                    if outcome.ttft_s is None:
                        outcome.ttft_s = now - sent
                    else:
                        outcome.itl_s.append(now - last)
                    last = now
                    text.append(piece)
        outcome.e2el_s = time.perf_counter() - sent
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:300]
        return
    if usage is not None:
        outcome.output_tokens = int(usage.get("completion_tokens") or 0)
        outcome.prompt_tokens = usage.get("prompt_tokens")
    else:
        outcome.output_tokens = count_tokens("".join(text))
    outcome.is_success = outcome.ttft_s is not None
    if not outcome.is_success:
        outcome.error = "the stream ended without a token or a finish reason"


async def run_requests(settings: ClientSettings, requests: list[BenchRequest], count_tokens: Callable[[str], int],
                       on_done: Callable[[RequestOutcome], None] = lambda _: None) -> tuple[list[RequestOutcome], float]:
    """Send every request at its arrival time; returns the outcomes (in request order) and the
    run's duration (first send to last completion)."""
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(settings.timeout_s, connect=30.0)
    semaphore = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None
    outcomes = [RequestOutcome(r) for r in requests]
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        run_start = time.perf_counter()

        async def one(outcome: RequestOutcome) -> None:
            await asyncio.sleep(max(0.0, run_start + outcome.request.arrival_s - time.perf_counter()))
            if semaphore is None:
                await send_one(client, settings, outcome, run_start, count_tokens)
            else:
                async with semaphore:
                    await send_one(client, settings, outcome, run_start, count_tokens)
            on_done(outcome)

        await asyncio.gather(*(one(o) for o in outcomes))
        duration = time.perf_counter() - run_start
    return outcomes, duration
