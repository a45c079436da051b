"""The requests on workers: which request each wire id names, the load each puts on its workers, the
workers each must avoid, and the wire ids the router cancelled.

A request's load lives in the registry's counters that routing reads: ``assign`` adds its share (decode
slots and blocks; the prompt tokens its prefill worker, or a decode worker prefilling locally, must
compute), ``release_prefill`` takes the prefill share back at its first token and ``unassign`` the rest.
``InFlightRequests`` is the one writer of a handle's route (``wire_id``, ``decode_worker_id``,
``prefill_worker_id``) and of its ``excluded`` workers.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from router.policy import Route
from router.registry import WorkerRegistry
from router.request_handle import RequestHandle

_MAX_REMEMBERED_CANCELS = 4096


@dataclass
class _Placement:
    """What one assigned request adds to its workers' counters, to be taken back exactly."""

    handle: RequestHandle
    assigned_at: float
    decode_worker_id: str | None = None  # whose num_inflight counts it (None: that worker had left the registry)
    num_slots: int = 0
    num_blocks: int = 0
    pending_prefill: tuple[str, int] | None = None  # (prefill worker, prompt tokens) counted there


class InFlightRequests:
    def __init__(self, registry: WorkerRegistry, on_slot_freed: Callable[[], None]) -> None:
        """``on_slot_freed``: called when a request leaves a decode worker's batch (the admission queue wakes)."""
        self.registry = registry
        self.on_slot_freed = on_slot_freed
        self._placements: dict[str, _Placement] = {}  # wire id -> the request there
        self._cancelled: OrderedDict[str, None] = OrderedDict()  # wire ids we cancelled: ignore their deltas

    def get(self, wire_id: str) -> RequestHandle | None:
        placement = self._placements.get(wire_id)
        return placement.handle if placement is not None else None

    def handles(self) -> list[RequestHandle]:
        """Every assigned request (a copy: the caller may assign and unassign meanwhile)."""
        return [placement.handle for placement in self._placements.values()]

    def assign(self, handle: RequestHandle, route: Route, wire_id: str) -> None:
        """``handle`` runs on ``route`` as ``wire_id`` (the message went out): count its load there."""
        handle.wire_id = wire_id
        handle.decode_worker_id = route.decode.worker_id
        handle.prefill_worker_id = route.prefill.worker_id if route.prefill else None
        placement = _Placement(handle, assigned_at=time.monotonic())
        self._placements[wire_id] = placement
        decode = self.registry.get(route.decode.worker_id)
        if decode is not None:
            placement.decode_worker_id = decode.worker_id
            placement.num_slots = handle.num_choices  # n > 1: n sequences in its batch
            # the KV it may grow to, as far as the client said (max_tokens): a long generation weighs as
            # what it will hold, so requests whose prefix one worker caches do not pile onto it
            potential = len(handle.prompt_token_ids) + (handle.sampling_params.max_tokens or 0)
            placement.num_blocks = -(-potential // max(decode.page_size, 1)) * handle.num_choices
            decode.num_inflight += placement.num_slots
            decode.num_inflight_blocks += placement.num_blocks
        if route.prefill is not None:
            prefill = self.registry.get(route.prefill.worker_id)
            if prefill is not None:
                # what it must compute: the prompt less what its prefix cache holds (0 without KV-aware routing)
                num_new = len(handle.prompt_token_ids) - route.prefill.num_cached_prompt_tokens
                prefill.num_pending_prefill_tokens += num_new
                prefill.num_routed_prefill_blocks += -(-num_new // max(prefill.page_size, 1))
                placement.pending_prefill = (prefill.worker_id, num_new)
        elif decode is not None:
            # a local prefill: the decode worker's own backlog, which spilling a prompt there weighs
            num_new = len(handle.prompt_token_ids) - route.decode.num_cached_prompt_tokens
            decode.num_pending_prefill_tokens += num_new
            placement.pending_prefill = (decode.worker_id, num_new)

    def unassign(self, handle: RequestHandle) -> float | None:
        """Take the request off its workers (no-op when it is on none). Returns how long it held a decode
        slot, or None when it held none (then no slot freed)."""
        handle.decode_worker_id = handle.prefill_worker_id = None
        placement = self._placements.pop(handle.wire_id, None)
        if placement is None:
            return None
        self._release_prefill(placement)
        decode = self.registry.get(placement.decode_worker_id) if placement.decode_worker_id else None
        if decode is None:
            return None
        decode.num_inflight = max(0, decode.num_inflight - placement.num_slots)
        decode.num_inflight_blocks = max(0, decode.num_inflight_blocks - placement.num_blocks)
        self.on_slot_freed()
        return time.monotonic() - placement.assigned_at

    def release_prefill(self, handle: RequestHandle) -> None:
        """The request's first token arrived: its prompt no longer weighs on its prefill worker."""
        placement = self._placements.get(handle.wire_id)
        if placement is not None:
            self._release_prefill(placement)

    def _release_prefill(self, placement: _Placement) -> None:
        if placement.pending_prefill is not None:
            worker_id, num_tokens = placement.pending_prefill
            placement.pending_prefill = None
            prefill = self.registry.get(worker_id)
            if prefill is not None:
                prefill.num_pending_prefill_tokens = max(0, prefill.num_pending_prefill_tokens - num_tokens)

    def exclude(self, handle: RequestHandle, worker_id: str) -> None:
        """``worker_id`` failed the request: route it elsewhere while that worker is in the same incarnation (the
        same process, not declared dead since: a restarted worker, or a frozen one that resumed, may serve it)."""
        info = self.registry.get(worker_id)
        handle.excluded[worker_id] = info.incarnation if info is not None else -1

    def excluded(self, handle: RequestHandle) -> set[str]:
        """The workers a request must avoid: those that failed it, while they are still in that incarnation."""
        return {worker_id for worker_id, incarnation in handle.excluded.items()
                if (info := self.registry.get(worker_id)) is None or info.incarnation == incarnation
                or incarnation == -1}

    def remember_cancel(self, wire_id: str) -> None:
        self._cancelled[wire_id] = None
        while len(self._cancelled) > _MAX_REMEMBERED_CANCELS:
            self._cancelled.popitem(last=False)

    def was_cancelled(self, wire_id: str) -> bool:
        return wire_id in self._cancelled
