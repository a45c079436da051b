"""A small open-loop load generator for the cluster tests: Poisson arrivals, mixed prompt lengths,
streaming requests through the official openai client, every outcome recorded (nothing asserted here)."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import httpx
import openai


@dataclass
class LoadRequest:
    prompt_ids: list[int]
    max_tokens: int
    arrival_s: float  # offset from the start of the run


@dataclass
class LoadResult:
    request: LoadRequest
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    status_code: int | None = None  # set when the request failed before streaming began
    ttft_s: float | None = None

    @property
    def is_ok(self) -> bool:
        return self.error is None and self.finish_reason is not None


def mixed_workload(num_requests: int, rate: float, *, long_fraction: float, long_len: int, long_out: int,
                   short_len: int, short_out: int, seed: int = 0, token_range: tuple[int, int] = (10, 290),
                   ) -> list[LoadRequest]:
    """Poisson arrivals at ``rate``/s; ``round(long_fraction * num_requests)`` long-prompt/short-output
    requests, at random places among short-prompt/long-output ones (the mix that makes prefill and
    decode fight)."""
    rng = random.Random(seed)
    num_long = round(long_fraction * num_requests)
    kinds = [True] * num_long + [False] * (num_requests - num_long)
    rng.shuffle(kinds)
    requests, t = [], 0.0
    for is_long in kinds:
        length, out = (long_len, long_out) if is_long else (short_len, short_out)
        requests.append(LoadRequest([rng.randrange(*token_range) for _ in range(length)], out, t))
        t += rng.expovariate(rate)
    return requests


def run_load(url: str, model: str, requests: list[LoadRequest], timeout_s: float = 60.0) -> list[LoadResult]:
    """Send every request at its arrival time (one thread each) and wait for all of them."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=timeout_s)
    results = [LoadResult(r) for r in requests]
    start = time.monotonic()

    def one(result: LoadResult) -> None:
        time.sleep(max(0.0, start + result.request.arrival_s - time.monotonic()))
        sent = time.monotonic()
        try:
            stream = client.completions.create(model=model, prompt=result.request.prompt_ids, temperature=0,
                                               max_tokens=result.request.max_tokens, stream=True)
            for chunk in stream:
                choice = chunk.choices[0]
                if result.ttft_s is None and choice.text:
                    result.ttft_s = time.monotonic() - sent
                result.text += choice.text
                result.finish_reason = choice.finish_reason or result.finish_reason
        except openai.APIStatusError as exc:
            result.status_code, result.error = exc.status_code, str(exc)
        except (openai.APIError, httpx.HTTPError) as exc:
            result.error = repr(exc)

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in results]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + requests[-1].arrival_s + 10)
    return results


@dataclass
class CpuHog:
    """A busy loop in a process of its own (one core), started and stopped by its owner."""

    process: object = field(default=None)

    def __enter__(self) -> "CpuHog":
        import subprocess
        import sys

        self.process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc) -> None:
        self.process.kill()
        self.process.wait(5)
