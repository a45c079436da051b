"""One request in flight at the router: its status, its handle (token queue, route, attempts, moves) and
the failure item that ends it when it cannot finish."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.protocol.cluster import TokenDelta
from pipeline.protocol.requests import SamplingParams
from router.request_trace import NO_TRACE


class RequestStatus(enum.Enum):
    """Where a request is in its life at the router. The usual path reads top to bottom; a stream that
    moves to another worker after its first token leaves STREAMING for MIGRATING (replayed) or HANDING_OFF
    (moved with its KV) and comes back with the new worker's first tokens. Any status but FINISHED may end.
    """

    QUEUED = "queued"  # waits in the admission queue for its first worker slot
    ROUTED = "routed"  # admitted: on a worker, no token yet (a retry between two attempts stays ROUTED)
    # under P/D, the prefill worker's first token is streamed; the decode worker's first delta repeats it
    FIRST_TOKEN_FROM_PREFILL = "first_token_from_prefill"
    STREAMING = "streaming"  # tokens reach the client
    # tokens sent and its worker lost (or failed it): replayed on another, or waiting for a slot to be
    MIGRATING = "migrating"
    HANDING_OFF = "handing_off"  # a draining worker's stream on its new worker, its KV fetched from ``kv_source``
    FINISHED = "finished"  # done, failed or cancelled: off every worker and out of the queue


_S = RequestStatus
# The moves set_status allows. MIGRATING -> MIGRATING: it moves again before the new worker's first tokens.
_NEXT_STATUSES: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.QUEUED: frozenset({_S.ROUTED, _S.FINISHED}),
    _S.ROUTED: frozenset({_S.FIRST_TOKEN_FROM_PREFILL, _S.STREAMING, _S.FINISHED}),
    _S.FIRST_TOKEN_FROM_PREFILL: frozenset({_S.STREAMING, _S.MIGRATING, _S.HANDING_OFF, _S.FINISHED}),
    _S.STREAMING: frozenset({_S.MIGRATING, _S.HANDING_OFF, _S.FINISHED}),
    _S.MIGRATING: frozenset({_S.MIGRATING, _S.HANDING_OFF, _S.STREAMING, _S.FINISHED}),
    _S.HANDING_OFF: frozenset({_S.HANDING_OFF, _S.MIGRATING, _S.STREAMING, _S.FINISHED}),
    _S.FINISHED: frozenset(),
}
_WITH_TOKENS = frozenset({_S.FIRST_TOKEN_FROM_PREFILL, _S.STREAMING, _S.MIGRATING, _S.HANDING_OFF})


@dataclass
class RequestFailed:
    """Put into a request's queue instead of a delta: the request cannot finish."""

    message: str
    status_code: int = 503  # 503: capacity / worker loss; 500: the worker reported an error


@dataclass
class RequestHandle:
    """One request at the router; ``router/serving.py`` reads its queue (``next``) and ``is_done``.

    Each field has one writer; everyone else only reads it:

    * ``request_id``, ``prompt_token_ids``, ``sampling_params``, ``deadline``, ``priority``, ``created_at``: set
      once, at creation (``Dispatcher.submit``).
    * ``status``: ``set_status`` alone, which allows only the moves of ``_NEXT_STATUSES``. The Dispatcher
      admits (ROUTED) and ends (FINISHED), TokenDelivery moves it as tokens arrive, Migration as the
      request moves.
    * ``admission``: the Dispatcher (``submit``, and the requeue of a retry).
    * ``wire_id``, ``decode_worker_id``, ``prefill_worker_id``, ``excluded``: ``InFlightRequests``.
    * ``num_attempts``: ``new_attempt``, once per ``GenerateRequest`` sent (Dispatcher, Migration's handoff).
    * ``num_excused_attempts``: Migration, when an attempt failed on a draining worker.
    * ``output_token_ids``, ``num_output_tokens``, ``first_token_at``, ``last_token_at``: TokenDelivery.
    * ``num_migrations``, ``paused_since``, ``kv_source``: Migration.
    * ``finished_choices``: the Dispatcher.
    * ``queue``: TokenDelivery puts the deltas, the Dispatcher the one ``RequestFailed`` that ends it.
    * ``trace``: set once by the Dispatcher (``submit``); the Dispatcher and Migration record on it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    deadline: float  # time.monotonic() after which the request fails
    priority: int = 0  # vLLM's: lower is served first (the admission queue's order; workers' under "priority")
    status: RequestStatus = RequestStatus.QUEUED
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    admission: asyncio.Future | None = None  # done once dispatched (see Dispatcher.wait_admitted)
    # the current attempt: its id on the wire and the workers it runs on (None: on none now)
    wire_id: str = ""
    decode_worker_id: str | None = None
    prefill_worker_id: str | None = None
    num_attempts: int = 0
    num_excused_attempts: int = 0  # attempts that failed on a worker stopping on purpose: not counted
    # workers that failed it, by the pid of the process that did: never routed there again, unless that
    # worker comes back as a new process (a restart, a rolling upgrade)
    excluded: dict[str, int] = field(default_factory=dict)
    output_token_ids: list[int] = field(default_factory=list)  # n == 1: every token forwarded (a migration resumes after them)
    num_output_tokens: int = 0  # every choice's tokens forwarded (n > 1 too): what its trace and log report
    first_token_at: float = 0.0  # time.monotonic() of its first token at the router (0: none yet)
    last_token_at: float = 0.0
    num_migrations: int = 0  # times it moved to another worker after its first token
    paused_since: float = 0.0  # MIGRATING / HANDING_OFF: when its last token before the move arrived
    # HANDING_OFF: (draining worker, the stream's wire id there), where the new worker fetches the KV from
    kv_source: tuple[str, str] | None = None
    finished_choices: set[int] = field(default_factory=set)  # n > 1: choices that ended (the request ends with the last)
    created_at: float = field(default_factory=time.monotonic)
    trace: Any = NO_TRACE  # its spans (router/request_trace.py): the Dispatcher and Migration record on it

    @property
    def num_choices(self) -> int:
        """Sequences the worker decodes for it (n, or best_of candidates): the worker slots it takes."""
        return self.sampling_params.num_sequences

    @property
    def is_admitted(self) -> bool:
        """Sent to a worker at least once (then counted in the in-flight gauges until it finishes)."""
        return self.status is not RequestStatus.QUEUED

    @property
    def has_tokens(self) -> bool:
        """Tokens reached the client: a move resumes after them (migration) instead of starting over (retry)."""
        return self.status in _WITH_TOKENS

    @property
    def is_done(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def kv_source_worker_id(self) -> str | None:
        """Where this attempt's KV comes from: the draining worker of a handoff, else its prefill worker."""
        if self.status is RequestStatus.HANDING_OFF and self.kv_source is not None:
            return self.kv_source[0]
        return self.prefill_worker_id

    def set_status(self, status: RequestStatus) -> None:
        if status not in _NEXT_STATUSES[self.status]:
            raise RuntimeError(f"request {self.request_id}: no move from {self.status.name} to {status.name}")
        self.status = status

    def new_attempt(self) -> str:
        """Count one more ``GenerateRequest`` for this request and return its wire id (the request id, then
        ``id~2``, ``id~3``...): each attempt has its own, so late messages of an old one cannot mix in."""
        self.num_attempts += 1
        return self.request_id if self.num_attempts == 1 else f"{self.request_id}~{self.num_attempts}"

    async def next(self) -> TokenDelta | RequestFailed:
        """The next delta or failure; raises TimeoutError once the deadline passed."""
        if not self.queue.empty():  # the common case under load: no timer, no task
            return self.queue.get_nowait()
        return await asyncio.wait_for(self.queue.get(), timeout=max(0.0, self.deadline - time.monotonic()))
