"""One request in flight at the router: its handle (token queue, route, attempts, admission) and the
failure item that ends it when it cannot finish."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pipeline.protocol.cluster import TokenDelta
from pipeline.protocol.requests import SamplingParams


@dataclass
class RequestFailed:
    """Put into a request's queue instead of a delta: the request cannot finish."""

    message: str
    status_code: int = 503  # 503: capacity / worker loss; 500: the worker reported an error


@dataclass
class RequestHandle:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    deadline: float  # time.monotonic() after which the request fails
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    wire_id: str = ""
    decode_worker_id: str | None = None
    prefill_worker_id: str | None = None
    num_attempts: int = 0
    # workers that failed it, by the pid of the process that did: never routed there again, unless that
    # worker comes back as a new process (a restart, a rolling upgrade)
    excluded: dict[str, int] = field(default_factory=dict)
    admission: asyncio.Future | None = None  # done once dispatched (see Dispatcher.wait_admitted)
    is_admitted: bool = False  # dispatched once: counted in the in-flight gauges until finished
    has_tokens: bool = False
    # the prefill worker streamed the first token: the decode worker's copy of it is dropped
    first_token_from_prefill: bool = False
    output_token_ids: list[int] = field(default_factory=list)  # n == 1: every token forwarded (a migration resumes after them)
    num_migrations: int = 0  # times it moved to another worker after its first token
    paused_since: float | None = None  # migrating: when its last token before the move arrived
    # live migration under way: (draining worker, the stream's wire id there) until the new worker's first tokens
    kv_source: tuple[str, str] | None = None
    finished_choices: set[int] = field(default_factory=set)  # n > 1: choices that ended (the request ends with the last)
    is_done: bool = False
    created_at: float = field(default_factory=time.monotonic)
    dispatched_at: float = 0.0
    last_token_at: float = 0.0
    _inflight_on: str | None = None  # the decode worker whose num_inflight counts this request
    _inflight_blocks: int = 0  # the prompt blocks counted in that worker's num_inflight_blocks
    _pending_prefill: tuple[str, int] | None = None  # (prefill worker, prompt tokens) counted there

    @property
    def num_choices(self) -> int:
        """Sequences the worker decodes for it (n, or best_of candidates): the worker slots it takes."""
        return self.sampling_params.num_sequences

    async def next(self) -> TokenDelta | RequestFailed:
        """The next delta or failure; raises TimeoutError once the deadline passed."""
        if not self.queue.empty():  # the common case under load: no timer, no task
            return self.queue.get_nowait()
        return await asyncio.wait_for(self.queue.get(), timeout=max(0.0, self.deadline - time.monotonic()))
