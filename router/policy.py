"""Which workers serve a request: a pure function of the workers' load reports.

Rules, in order:

1. Candidates are live workers whose ``max_length`` fits the request, minus any excluded ones
   (a retry excludes the workers that just failed it).
2. Decode candidates are PrefillAndDecode workers, plus DecodeOnly workers when at least one
   PrefillOnly worker (with an endpoint) is a candidate: a DecodeOnly worker cannot prefill.
3. The decode worker is the least loaded candidate: workers with free KV blocks first, then the
   fewest requests (the router's own in-flight count, which is fresher than the last heartbeat, or the
   reported running + waiting if larger), then the most free blocks, then the id (determinism).
4. A PrefillAndDecode worker serves alone (prefill None). A DecodeOnly worker is paired with the
   prefill candidate with the fewest queued prefill tokens (reported plus what the router sent since).
5. No decode candidate -> ``NoRoute`` with the reason (the HTTP layer answers 503).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from pipeline.config import PipelineRole


@dataclass(frozen=True)
class WorkerView:
    """What the policy needs to know about one worker (a snapshot)."""

    worker_id: str
    role: PipelineRole
    max_length: int
    prefill_endpoint: str | None = None
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_queued_prefill_tokens: int = 0
    num_inflight: int = 0  # router-side: routed here, not finished
    num_pending_prefill_tokens: int = 0  # router-side: prompt tokens sent here without a first token yet


@dataclass(frozen=True)
class Route:
    decode: WorkerView
    prefill: WorkerView | None  # None: the decode worker prefills itself (colocated)


class NoRoute(Exception):
    """No live worker combination can serve the request; ``str()`` says why."""


def choose_route(
    workers: Sequence[WorkerView], num_tokens: int, exclude: Iterable[str] = ()
) -> Route:
    """Pick (prefill or None, decode) for a request needing ``num_tokens`` (prompt + max output)."""
    excluded = set(exclude)
    fitting = [w for w in workers if w.worker_id not in excluded and w.max_length >= num_tokens]
    prefill = [w for w in fitting if w.role == PipelineRole.PrefillOnly and w.prefill_endpoint]
    colocated = [w for w in fitting if w.role == PipelineRole.PrefillAndDecode]
    decode_only = [w for w in fitting if w.role == PipelineRole.DecodeOnly]
    decode_candidates = colocated + (decode_only if prefill else [])
    if not decode_candidates:
        raise NoRoute(_why_none(workers, excluded, num_tokens, prefill, decode_only))
    decode = min(decode_candidates, key=_decode_key)
    if decode.role == PipelineRole.PrefillAndDecode:
        return Route(decode=decode, prefill=None)
    return Route(decode=decode, prefill=min(prefill, key=_prefill_key))


def _decode_key(w: WorkerView) -> tuple:
    num_requests = max(w.num_inflight, w.num_running + w.num_waiting)
    return (w.num_free_blocks <= 0, num_requests, -w.num_free_blocks, w.worker_id)


def _prefill_key(w: WorkerView) -> tuple:
    return (w.num_queued_prefill_tokens + w.num_pending_prefill_tokens, w.worker_id)


def _why_none(
    workers: Sequence[WorkerView],
    excluded: set[str],
    num_tokens: int,
    prefill: list[WorkerView],
    decode_only: list[WorkerView],
) -> str:
    usable = [w for w in workers if w.worker_id not in excluded]
    if not usable:
        return "no live workers" if not workers else "no other live worker to retry on"
    if all(w.max_length < num_tokens for w in usable):
        longest = max(w.max_length for w in usable)
        return f"no live worker accepts {num_tokens} tokens (prompt + max_tokens); the largest max_length is {longest}"
    if decode_only and not prefill:
        return "only DecodeOnly workers are alive and no PrefillOnly worker can prefill for them"
    return "no decode-capable (DecodeOnly or PrefillAndDecode) worker is alive"
