"""The router's view of its workers: who registered, their last load report, and who is alive.

A worker is alive while its last message (any message counts) is younger than ``dead_after_s``.
Workers heartbeat from a thread that no engine step blocks (their load report says how long the
current step has run), so silence means a gone or frozen process, never a busy one.
``check_liveness()`` (called periodically by the dispatcher) marks the silent ones dead once and calls
``on_worker_dead`` for each; a check that comes late (the router itself was starved of CPU, so it may
not have read the heartbeats waiting on its socket) declares nobody dead. A dead worker that speaks again comes back to life with its old record;
a worker that registers again with a new pid is a new incarnation: the old one is declared dead first.
A worker dead for ``forget_after_s`` is forgotten: it leaves ``/ready`` and the per-worker metrics (a worker
scaled down, or given up by its launcher, is not listed for ever); if it speaks again it is asked to register anew.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from pipeline.config import PipelineRole
from pipeline.protocol.cluster import PROTOCOL_VERSION, Heartbeat, KVEvents, RegisterWorker, WorkerLoad, WorkerRole
from router.kv_index import KVIndex, PromptHashes
from router.policy import WorkerView

logger = logging.getLogger(__name__)


@dataclass
class WorkerInfo:
    worker_id: str
    role: PipelineRole
    model_name: str
    max_length: int
    page_size: int
    num_total_blocks: int
    prefill_endpoint: str | None
    pid: int
    load: WorkerLoad
    last_seen: float
    is_alive: bool = True
    num_inflight: int = 0  # requests the router has routed here and not seen finish (decode side)
    num_pending_prefill_tokens: int = 0  # prompt tokens routed here to prefill (or prefill locally), no first token yet
    max_batch_size: int = 0  # from registration; 0: unknown
    registered_at: float = field(default_factory=time.time)
    num_inflight_blocks: int = 0  # blocks (prompt + max_tokens) of the requests routed here (decode side), not finished
    num_routed_prefill_blocks: int = 0  # cumulative: prompt blocks the router sent here to compute (prefill side)
    num_restarts: int = 0  # registrations under this worker id by a new process (a restart, a rolling replace)
    # +1 each time this worker id comes back: a new process, or the same one heard from again after it was declared
    # dead (frozen, then resumed); a request that failed on a worker avoids it for that incarnation only
    incarnation: int = 0
    rank_pids: list[int] = field(default_factory=list)  # tensor parallelism: ranks 1..N-1 (``pid`` is rank 0)

    def view(self, num_cached_prompt_tokens: int = 0) -> WorkerView:
        """The snapshot the routing policy decides on (``num_cached_prompt_tokens``: of the request being routed)."""
        load = self.load
        return WorkerView(
            worker_id=self.worker_id, role=self.role, max_length=self.max_length,
            prefill_endpoint=self.prefill_endpoint, num_free_blocks=load.num_free_blocks,
            num_total_blocks=load.num_total_blocks or self.num_total_blocks, num_running=load.num_running,
            num_waiting=load.num_waiting, num_queued_prefill_tokens=load.num_queued_prefill_tokens,
            num_inflight=self.num_inflight, num_pending_prefill_tokens=self.num_pending_prefill_tokens,
            max_batch_size=self.max_batch_size, is_draining=load.is_draining, page_size=self.page_size,
            num_cached_prompt_tokens=num_cached_prompt_tokens, num_inflight_blocks=self.num_inflight_blocks,
            num_routed_prefill_blocks=self.num_routed_prefill_blocks,
        )

    @property
    def can_decode(self) -> bool:
        return self.role in (PipelineRole.PrefillAndDecode, PipelineRole.DecodeOnly)

    @property
    def can_prefill_for_others(self) -> bool:
        return self.role == PipelineRole.PrefillOnly and bool(self.prefill_endpoint)


def registration_refusal(routing_id: str, msg: RegisterWorker, model_name: str) -> str | None:
    """Why a worker may not register with a router serving ``model_name`` (None: it may): its id is not its
    socket's, it speaks another protocol version, serves another model, or is a prefill worker with no endpoint."""
    if msg.worker_id != routing_id:
        return f"worker_id {msg.worker_id!r} differs from the socket routing id {routing_id!r}"
    if msg.protocol_version != PROTOCOL_VERSION:
        return f"protocol version {msg.protocol_version} != router's {PROTOCOL_VERSION}"
    if msg.model_name != model_name:
        return f"model {msg.model_name!r} differs from the router's {model_name!r}"
    if msg.role == WorkerRole.PREFILL_ONLY and not msg.prefill_endpoint:
        return "a PrefillOnly worker must report its prefill_endpoint"
    return None


class WorkerRegistry:
    def __init__(
        self,
        heartbeat_interval_s: float,
        dead_after_s: float,
        on_worker_dead: Callable[[WorkerInfo], None] | None = None,
        on_worker_registered: Callable[[WorkerInfo], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        forget_after_s: float | None = None,
        on_worker_forgotten: Callable[[str], None] | None = None,
    ) -> None:
        if heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s: must be > 0 (got {heartbeat_interval_s})")
        if dead_after_s <= heartbeat_interval_s:
            raise ValueError(
                f"dead_after_s: must be > heartbeat_interval_s ({heartbeat_interval_s}) (got {dead_after_s})"
            )
        if forget_after_s is not None and forget_after_s <= 0:
            raise ValueError(f"forget_after_s: must be > 0 (got {forget_after_s})")
        self.heartbeat_interval_s = heartbeat_interval_s
        self.dead_after_s = dead_after_s
        self.forget_after_s = forget_after_s
        self.on_worker_forgotten = on_worker_forgotten
        self.on_worker_dead = on_worker_dead
        self.on_worker_registered = on_worker_registered
        self._clock = clock
        self._workers: dict[str, WorkerInfo] = {}
        self._last_check: float | None = None
        self._started_at = clock()
        self._last_stranger_heartbeat = -math.inf  # a worker this router does not know (yet) heartbeated
        self.kv_index = KVIndex()  # the prefix-cache blocks each live worker holds

    # -------------------------------------------------------------- updates from messages

    def register(self, msg: RegisterWorker) -> WorkerInfo:
        """Add or replace a worker. A live worker re-registering with another pid is a restart."""
        old = self._workers.get(msg.worker_id)
        if old is not None and old.is_alive and old.pid != msg.pid:
            logger.warning("worker %s restarted (pid %d -> %d)", msg.worker_id, old.pid, msg.pid)
            self._declare_dead(old)
        role = WorkerRole(msg.role).to_pipeline_role()
        info = WorkerInfo(
            worker_id=msg.worker_id,
            role=role,
            model_name=msg.model_name,
            max_length=msg.max_length,
            page_size=msg.page_size,
            num_total_blocks=msg.num_total_blocks,
            prefill_endpoint=msg.prefill_endpoint,
            pid=msg.pid,
            max_batch_size=msg.max_batch_size,
            rank_pids=list(msg.rank_pids),
            load=WorkerLoad(num_free_blocks=msg.num_total_blocks, num_total_blocks=msg.num_total_blocks),
            last_seen=self._clock(),
        )
        if old is not None:
            info.num_restarts = old.num_restarts + (old.pid != msg.pid)
            info.incarnation = old.incarnation + (old.pid != msg.pid or not old.is_alive)
        if old is not None and old.pid == msg.pid:  # the same process again: keep the router's counts
            info.num_inflight = old.num_inflight
            info.num_pending_prefill_tokens = old.num_pending_prefill_tokens
            info.num_inflight_blocks = old.num_inflight_blocks
        self._workers[msg.worker_id] = info
        self.kv_index.register(msg.worker_id, msg.page_size, msg.num_total_blocks)  # its snapshot follows
        logger.info("worker %s registered: %s, pid %d", msg.worker_id, role.value, msg.pid)
        if self.on_worker_registered is not None:
            self.on_worker_registered(info)
        return info

    def heartbeat(self, msg: Heartbeat) -> WorkerInfo | None:
        """Record a load report; None when the worker is unknown (it must register)."""
        info = self.touch(msg.worker_id)
        if info is not None:
            info.load = msg.load
        else:
            self._last_stranger_heartbeat = self._clock()
        return info

    def registration_due_s(self) -> float:
        """How long a request no live worker can serve may wait for a worker to register now (0: none is due):
        through this router's first ``dead_after_s`` (restarted, it has a cluster's workers back within a
        heartbeat or two: they register again on their own), and for ``dead_after_s`` after a worker it does not
        know heartbeated (one asked to register again)."""
        due = max(self._started_at, self._last_stranger_heartbeat) + self.dead_after_s
        return max(0.0, due - self._clock())

    def kv_events(self, msg: KVEvents) -> bool:
        """Apply a worker's prefix-cache changes to the index; False: it must send a snapshot (register again)."""
        info = self.touch(msg.worker_id)
        if info is None:
            return False
        return self.kv_index.apply(msg.worker_id, msg.seq, msg.stored, msg.removed, msg.full)

    def views(self, prompt: PromptHashes | None = None) -> list[WorkerView]:
        """Live workers as the policy sees them, with what each caches of ``prompt`` (None: not looked up)."""
        return [w.view(self.kv_index.cached_prefix_tokens(w.worker_id, prompt) if prompt is not None else 0)
                for w in self.live_workers()]

    def touch(self, worker_id: str) -> WorkerInfo | None:
        """Any message from a worker proves it is alive; returns None for unknown workers."""
        info = self._workers.get(worker_id)
        if info is None:
            return None
        info.last_seen = self._clock()
        if not info.is_alive:
            logger.warning("worker %s is back after being declared dead", worker_id)
            info.is_alive = True
            info.incarnation += 1
        return info

    def remove(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    # -------------------------------------------------------------- liveness

    def check_liveness(self) -> list[WorkerInfo]:
        """Declare dead every live worker silent for ``dead_after_s``; returns those."""
        now = self._clock()
        last_check, self._last_check = self._last_check, now
        if last_check is not None and now - last_check > max(self.heartbeat_interval_s * 2, self.dead_after_s / 2):
            logger.warning("router liveness check ran %.1f s after the previous one (the router itself was "
                           "stalled): this round is skipped, no worker is judged on it", now - last_check)
            return []
        newly_dead = [w for w in self._workers.values() if w.is_alive and now - w.last_seen > self.dead_after_s]
        for info in newly_dead:
            if info.load.is_draining:  # it said it was going: a shutdown, not a fault
                logger.info("worker %s drained and stopped (silent for %.1f s)", info.worker_id, now - info.last_seen)
            else:
                logger.warning("worker %s missed heartbeats for %.1f s: declared dead", info.worker_id,
                               now - info.last_seen)
            self._declare_dead(info)
        self._forget_long_dead(now)
        return newly_dead

    def _forget_long_dead(self, now: float) -> None:
        if self.forget_after_s is None:
            return
        for info in [w for w in self._workers.values() if not w.is_alive and now - w.last_seen > self.forget_after_s]:
            logger.info("worker %s: dead for %.0f s, forgotten (it registers anew if it comes back)", info.worker_id,
                        now - info.last_seen)
            del self._workers[info.worker_id]
            if self.on_worker_forgotten is not None:
                self.on_worker_forgotten(info.worker_id)

    def _declare_dead(self, info: WorkerInfo) -> None:
        info.is_alive = False
        self.kv_index.forget(info.worker_id)  # a worker that comes back re-registers and sends a snapshot
        if self.on_worker_dead is not None:
            self.on_worker_dead(info)
        info.num_inflight = 0
        info.num_pending_prefill_tokens = 0
        info.num_inflight_blocks = 0

    # -------------------------------------------------------------- queries

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    def is_alive(self, worker_id: str) -> bool:
        info = self._workers.get(worker_id)
        return info is not None and info.is_alive

    def live_workers(self) -> list[WorkerInfo]:
        return [w for w in self._workers.values() if w.is_alive]

    def all_workers(self) -> list[WorkerInfo]:
        return list(self._workers.values())

    def expects_a_decode_worker_back(self, model_name: str, within_s: float) -> bool:
        """Whether a decode-capable worker of ``model_name`` drains now, or was last heard of at most ``within_s``
        ago, drained or dead: a rolling restart's replacement is on its way (``tandem up``'s SIGHUP, ``tandem ray
        restart``), or its launcher restarts it (a crash), so a request nobody can serve meanwhile may wait for
        it (an audit saw every queued request of a 1P1D cluster fail with a 503 the moment its decode worker
        was declared dead, the restarted worker back seconds later)."""
        now = self._clock()
        return any(w.can_decode and w.model_name == model_name
                   and (w.load.is_draining if w.is_alive else now - w.last_seen <= within_s)
                   for w in self._workers.values())

    def readiness(self) -> tuple[bool, str]:
        """(ready, why): a decode-capable worker is alive (DecodeOnly workers prefill locally when no
        PrefillOnly worker is)."""
        live = self.live_workers()
        colocated = [w for w in live if w.role == PipelineRole.PrefillAndDecode]
        decode_only = [w for w in live if w.role == PipelineRole.DecodeOnly]
        prefill = [w for w in live if w.can_prefill_for_others]
        if colocated:
            return True, f"{len(colocated)} PrefillAndDecode worker(s) alive"
        if decode_only and prefill:
            return True, f"{len(decode_only)} DecodeOnly and {len(prefill)} PrefillOnly worker(s) alive"
        if decode_only:
            return True, f"{len(decode_only)} DecodeOnly worker(s) alive, prefilling locally (no PrefillOnly worker is)"
        if prefill:
            return False, "PrefillOnly workers are alive but no decode-capable (DecodeOnly or PrefillAndDecode) worker is"
        return False, "no live workers"
