"""The multi-turn workload (``tandem bench serve --dataset multi-turn``): conversations, not requests.

Each session is a chat that grows: every turn's prompt is the previous prompt, the answer the server
gave, and a new user message, all as token ids (the answer's ids come back with the stream through
``return_tokens_as_token_ids``, so a turn repeats the last one exactly, as a chat client that keeps
token ids would). Every session opens with the same system prompt, so prefixes repeat across sessions
too. Sessions start at a seeded Poisson rate; within one, the next turn is sent a think time (fixed, or
drawn from a seeded exponential distribution) after the
answer ended (closed loop: a slow server delays the later turns, as it would a user).

What it reports: TTFT per turn index (turn 1 computes everything; later turns are where KV reuse shows),
prompt tokens and the tokens the serving worker already held (``usage.prompt_tokens_details``), and,
from a Tandem router's /metrics, KV bytes moved and prefix hit rates at routing time.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from bench.serve_client import sse_lines

PAGE_SIZE = 16  # the workers' default KV page: a held prompt is held to its last full page


@dataclass(frozen=True)
class SessionSpec:
    num_sessions: int = 16
    num_turns: int = 4
    system_len: int = 256  # shared by every session
    user_len: int = 64  # each turn's new message
    output_len: int = 32  # each answer (sent with ignore_eos, so every answer has this length)
    session_rate: float = 1.0  # sessions started per second (Poisson)
    think_time_s: float = 1.0  # between an answer's end and the next turn (the mean, when exponential)
    # "fixed": every pause is think_time_s; "exponential": seeded draws with that mean, as people read and type
    # at their own pace (fixed pauses keep conversations that started together in step, turn after turn)
    think_time_distribution: str = "fixed"
    seed: int = 0
    system_seed: int | None = None  # the system prompt's seed (None: ``seed``), so other sessions can share it


@dataclass
class TurnOutcome:
    session: int
    turn: int  # 1-based
    prompt_tokens: int
    cached_tokens: int = 0
    ttft_s: float | None = None
    e2el_s: float | None = None
    output_tokens: int = 0
    error: str | None = None


@dataclass
class _Session:
    index: int
    start_s: float
    messages: list[list[int]]
    think_times_s: list[float] = field(default_factory=list)  # after each turn but the last
    outcomes: list[TurnOutcome] = field(default_factory=list)


def build_sessions(spec: SessionSpec, vocab_size: int, special_ids: set[int]) -> list[_Session]:
    """Seeded sessions: start times and every turn's user message (token ids outside the special ones)."""
    rng = random.Random(spec.seed)
    ordinary = [t for t in range(vocab_size) if t not in special_ids]
    starts = np.cumsum(np.random.default_rng(spec.seed).exponential(1.0 / spec.session_rate, spec.num_sessions))
    system = [rng.choice(ordinary) for _ in range(spec.system_len)]
    if spec.system_seed is not None:  # another seed's system prompt; the messages still draw from ``seed``
        system_rng = random.Random(spec.system_seed)
        system = [system_rng.choice(ordinary) for _ in range(spec.system_len)]
    if spec.think_time_distribution not in ("fixed", "exponential"):
        raise ValueError(f"think_time_distribution: 'fixed' or 'exponential', not {spec.think_time_distribution!r}")
    pauses = np.random.default_rng([spec.seed, 1])
    sessions = []
    for i in range(spec.num_sessions):
        turns = [[rng.choice(ordinary) for _ in range(spec.user_len)] for _ in range(spec.num_turns)]
        turns[0] = system + turns[0]
        think = ([spec.think_time_s] * (spec.num_turns - 1) if spec.think_time_distribution == "fixed"
                 else pauses.exponential(spec.think_time_s, spec.num_turns - 1).tolist())
        sessions.append(_Session(i, float(starts[i] - starts[0]), turns, think))
    return sessions


async def _turn(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int,
                outcome: TurnOutcome) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    sent = time.perf_counter()
    answer: list[int] = []
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:200]}"
                return answer
            async for line in sse_lines(response):
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    outcome.error = json.dumps(chunk["error"])[:200]
                    return answer
                for choice in chunk.get("choices") or ():
                    tokens = (choice.get("logprobs") or {}).get("tokens") or []
                    if tokens and outcome.ttft_s is None:
                        outcome.ttft_s = time.perf_counter() - sent
                    answer += [int(t.removeprefix("token_id:")) for t in tokens]
                usage = chunk.get("usage")
                if usage:
                    outcome.output_tokens = usage["completion_tokens"]
                    outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        outcome.e2el_s = time.perf_counter() - sent
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:200]
    return answer


async def run_sessions(base_url: str, model: str, spec: SessionSpec, sessions: list[_Session],
                       api_key: str | None = None) -> tuple[list[TurnOutcome], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(600.0, connect=30.0)) as client:
        start = time.perf_counter()

        async def one(session: _Session) -> None:
            await asyncio.sleep(session.start_s)
            prompt: list[int] = []
            for turn, message in enumerate(session.messages, start=1):
                prompt = prompt + message
                outcome = TurnOutcome(session.index, turn, len(prompt))
                session.outcomes.append(outcome)
                answer = await _turn(client, f"{base_url}/v1/completions", model, prompt, spec.output_len, outcome)
                if outcome.error is not None:
                    return  # the conversation cannot go on without its answer
                prompt = prompt + answer
                if turn < len(session.messages):
                    await asyncio.sleep(session.think_times_s[turn - 1])

        await asyncio.gather(*(one(s) for s in sessions))
        duration = time.perf_counter() - start
    return [o for s in sessions for o in s.outcomes], duration


def summarize_turns(outcomes: list[TurnOutcome], duration_s: float) -> dict:
    """Per turn index and over later turns (>= 2): TTFT percentiles, median TPOT, prompt and held tokens;
    the later turns again, split by whether the serving worker held the previous turn's prompt."""
    done = [o for o in outcomes if o.error is None and o.ttft_s is not None]

    def stats(items: list[TurnOutcome]) -> dict:
        ttfts = [o.ttft_s * 1000 for o in items]
        tpots = [(o.e2el_s - o.ttft_s) * 1000 / (o.output_tokens - 1) for o in items
                 if o.e2el_s is not None and o.output_tokens > 1]
        prompt = sum(o.prompt_tokens for o in items)
        cached = sum(o.cached_tokens for o in items)
        return {"count": len(items),
                "median_ttft_ms": float(np.median(ttfts)) if ttfts else None,
                "p90_ttft_ms": float(np.percentile(ttfts, 90)) if ttfts else None,
                "median_tpot_ms": float(np.median(tpots)) if tpots else None,
                "prompt_tokens": prompt, "cached_tokens": cached,
                "cached_fraction": cached / prompt if prompt else 0.0}

    turns = sorted({o.turn for o in done})
    later = [o for o in done if o.turn >= 2]
    # a later turn found its conversation when the serving worker held all of the previous turn's prompt
    # (to its last full page): what it lacked was the last answer's tail and the new message
    previous = {(o.session, o.turn): o.prompt_tokens for o in outcomes}
    held = [o for o in later if o.cached_tokens >= previous.get((o.session, o.turn - 1), 10**9) - PAGE_SIZE]
    missed = [o for o in later if o not in held]
    return {
        "completed_turns": len(done), "failed_turns": len(outcomes) - len(done), "duration_s": duration_s,
        "output_throughput": sum(o.output_tokens for o in done) / duration_s if duration_s else 0.0,
        "per_turn": {str(t): stats([o for o in done if o.turn == t]) for t in turns},
        "later_turns": stats(later),
        "later_turns_held_previous": stats(held),
        "later_turns_missed_previous": stats(missed),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
    }
