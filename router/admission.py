"""The router's admission queue: who waits for a free worker slot, in what order, and until when.

When every worker runs a full batch the router does not fail a request, nor push it onto a worker
that would only queue it: the request waits here until a slot frees, by (priority, arrival): vLLM's
``priority``, lower first, then first in first out (``router/waiting_line.py``; with every priority at
its default 0, plain FIFO). The queue is bounded; a request that finds it full, or waits longer than
``queue_timeout_s``, is ``Overloaded`` (the HTTP layer answers 429 with ``Retry-After``) before any
response started. One exception to "full means 429": a newcomer of better (lower) priority than the
worst request waiting takes its place, and that one is answered 429 (``Displaced``) instead; it had
waited for admission, so no response of it had started. Requests admitted once (``at_front``: retries,
migrations of streams under way) are never displaced.

The queue never decides routes. Its owner passes ``try_admit(item)``, which dispatches the item and
returns True, returns False while every worker is saturated, or raises (e.g. ``NoRoute``: nobody can
serve it at all, which fails that item only). The owner calls ``wake()`` whenever a slot may have
freed (a request finished, a worker registered or reported load); the queue then admits from its
head, in order, on the event loop's next turn, so a burst of wake-ups costs one pass. The queue
admits on the waiter's behalf (rather than waking it to try itself), so no newcomer can take the slot
between the wake-up and the waiter's turn.

Everything runs on one asyncio event loop: no locks.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from router.waiting_line import WaitingLine

T = TypeVar("T")

MAX_RETRY_AFTER_S = 60  # clients (the openai SDK among them) ignore or cap longer server-directed delays


class Overloaded(Exception):
    """The request cannot wait for a slot: the queue is full, or it waited past ``queue_timeout_s``.

    ``retry_after_s`` is when the client should try again (whole seconds, >= 1); the owner of the queue,
    who knows the cluster's slots and service times, fills it in.
    """

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Displaced(Overloaded):
    """The queue was full and a request of better priority took this waiting request's place (a 429)."""


@dataclass(eq=False)
class _Waiter(Generic[T]):
    item: T
    future: asyncio.Future  # result None once admitted; exception Overloaded / what try_admit raised
    priority: int = 0
    timer: asyncio.TimerHandle | None = None
    counted: bool = True  # against ``max_queued_requests`` (a request's further prompts are not)
    waits_for_a_route: bool = False  # nobody can serve it now: it waits for a worker that can (a restart)
    no_route: Exception | None = None  # why nobody could, the last time it was tried


class AdmissionQueue(Generic[T]):
    def __init__(self, try_admit: Callable[[T], bool], max_queued_requests: int, queue_timeout_s: float,
                 may_wait_for_a_route: Callable[[Exception], bool] | None = None) -> None:
        """``may_wait_for_a_route(error)``: whether a waiter that ``try_admit`` now refuses with ``error`` (nobody
        can serve it: the only worker that could died) waits for a worker to come back instead of failing."""
        if max_queued_requests < 0:
            raise ValueError(f"max_queued_requests: must be >= 0 (got {max_queued_requests})")
        if queue_timeout_s <= 0:
            raise ValueError(f"queue_timeout_s: must be > 0 (got {queue_timeout_s})")
        self.try_admit = try_admit
        self.may_wait_for_a_route = may_wait_for_a_route
        self.max_queued_requests = max_queued_requests
        self.queue_timeout_s = queue_timeout_s
        self._waiters: dict[int, _Waiter[T]] = {}  # id(item) -> waiter
        self._line: WaitingLine[_Waiter[T]] = WaitingLine()  # the same waiters, in admission order
        self._num_counted = 0  # waiters counted against max_queued_requests
        self._is_pump_scheduled = False

    def __len__(self) -> int:
        """Requests waiting now."""
        return len(self._waiters)

    def __contains__(self, item: T) -> bool:
        return id(item) in self._waiters

    def enqueue(self, item: T, *, at_front: bool = False, timeout_s: float | None = None,
                priority: int = 0, counted: bool = True, waits_for_a_route: bool = False) -> asyncio.Future:
        """Admit ``item`` now or queue it; the returned future resolves (None) once it was admitted.

        Nobody waiting ahead and ``try_admit(item)`` succeeding: the future is already done. Otherwise
        the item queues by (``priority``, arrival), or with ``at_front`` ahead of everyone (work already
        admitted once, such as a retry after a worker died: it passes the queue and ignores its bound).
        Raises at once, queueing nothing: ``Overloaded`` when the queue is full of requests as good as
        this one or better, and whatever ``try_admit`` raises. The bound counts requests, not prompts: a request
        carrying several prompts enqueues its first one ``counted`` and the rest not (they wait, in order, but
        neither count nor are refused). With ``waits_for_a_route`` (a stream whose worker died) what ``try_admit``
        raises does not fail it: it waits, holding nobody back, until a worker that can serve it registers, and
        on timeout fails with that error rather than ``Overloaded``. Later failures arrive through the future:
        ``Overloaded`` after waiting ``queue_timeout_s`` (or ``timeout_s`` if shorter: the request's own
        deadline), ``Displaced`` when a better request took its place, or what ``try_admit`` raised on a
        later pass.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        no_route = None
        try:
            if (at_front or not self._waiters) and self.try_admit(item):
                future.set_result(None)
                return future
        except Exception as exc:
            if not waits_for_a_route:
                raise
            no_route = exc
        if not at_front and counted and self._num_counted >= self.max_queued_requests:
            self._displace_for(priority)
        waiter = _Waiter(item, future, priority, counted=counted, waits_for_a_route=waits_for_a_route,
                         no_route=no_route)
        wait_s = self.queue_timeout_s if timeout_s is None else min(self.queue_timeout_s, timeout_s)
        waiter.timer = loop.call_later(wait_s, self._expire, waiter, wait_s)
        self._waiters[id(item)] = waiter
        self._num_counted += counted
        self._line.add(waiter, priority, at_front=at_front)
        # A future done while still queued was cancelled (its awaiting task was): drop the waiter.
        future.add_done_callback(lambda _: self._drop(waiter))
        self.wake()  # a slot may have freed since the last pass
        return future

    def discard(self, item: T) -> None:
        """Take ``item`` out of the queue (it was cancelled); no-op when it is not queued."""
        waiter = self._waiters.pop(id(item), None)
        if waiter is None:
            return
        self._num_counted -= waiter.counted
        self._line.remove(waiter)
        if waiter.timer is not None:
            waiter.timer.cancel()
        if not waiter.future.done():
            waiter.future.cancel()
        self.wake()  # it may have been the head that held the others back

    def wake(self) -> None:
        """A slot may have freed: admit from the head on the loop's next turn (coalesced)."""
        if not self._waiters or self._is_pump_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (called from plain code): there can be no waiters to wake either
            return
        self._is_pump_scheduled = True
        loop.call_soon(self._pump)

    def close(self, error: Exception) -> None:
        """Fail every waiter with ``error`` (the router is shutting down)."""
        waiters, self._waiters, self._line, self._num_counted = list(self._line), {}, WaitingLine(), 0
        for waiter in waiters:
            self._resolve(waiter, error)

    def depth_by_priority(self, label: Callable[[int], str]) -> dict[str, int]:
        """Requests waiting now, per ``label(priority)``."""
        return self._line.count_by(label)

    # ------------------------------------------------------------------ internals

    def _displace_for(self, priority: int) -> None:
        """The queue is full: fail the worst waiting request if ``priority`` is better, else raise ``Overloaded``."""
        victim = self._line.displaceable_by(priority)
        if victim is None:
            raise Overloaded(
                "every worker is busy and the router's admission queue is full "
                f"({self.max_queued_requests} requests waiting); try again later"
            )
        self._pop_and_resolve(victim, Displaced(
            f"every worker is busy and the router's admission queue is full: a request of priority {priority} "
            f"took the place of this one (priority {victim.priority}); try again later"
        ))

    def _pump(self) -> None:
        self._is_pump_scheduled = False
        passed = 0  # waiters at the head that no worker can serve yet, left in line this pass
        while passed < len(self._line):
            waiter = self._line.at(passed)
            if waiter.future.done():  # cancelled; its done callback has not run yet
                self._pop_and_resolve(waiter, None)
                continue
            try:
                is_admitted = self.try_admit(waiter.item)
            except Exception as exc:
                if not waiter.waits_for_a_route and self.may_wait_for_a_route is not None:
                    waiter.waits_for_a_route = self.may_wait_for_a_route(exc)
                if waiter.waits_for_a_route:  # nobody can serve it until a worker comes back: the rest go on
                    waiter.no_route = exc
                    passed += 1
                    continue
                self._pop_and_resolve(waiter, exc)  # this one can never be served (no worker fits it): it alone fails
                continue
            if not is_admitted:
                waiter.no_route = None  # a worker can serve it: it waits for a slot like the others
                return  # still saturated: the ones behind it wait too (in line order)
            self._pop_and_resolve(waiter, None)

    def _drop(self, waiter: _Waiter[T]) -> None:
        if self._waiters.get(id(waiter.item)) is waiter:
            self.discard(waiter.item)

    def _expire(self, waiter: _Waiter[T], wait_s: float) -> None:
        if self._waiters.get(id(waiter.item)) is not waiter:
            return
        if waiter.no_route is not None:  # it waited for a worker that can serve it, and none came
            self._pop_and_resolve(waiter, waiter.no_route)
        else:
            self._pop_and_resolve(waiter, Overloaded(
                f"every worker stayed busy for the {wait_s:.3g} s this request could wait; try again later"
            ))
        self.wake()  # if it was the head, the ones behind it may fit where it did not

    def _pop_and_resolve(self, waiter: _Waiter[T], error: Exception | None) -> None:
        if self._waiters.pop(id(waiter.item), None) is not None:
            self._num_counted -= waiter.counted
            self._line.remove(waiter)
        self._resolve(waiter, error)

    @staticmethod
    def _resolve(waiter: _Waiter[T], error: Exception | None) -> None:
        if waiter.timer is not None:
            waiter.timer.cancel()
        if waiter.future.done():
            return
        if error is None:
            waiter.future.set_result(None)
        else:
            waiter.future.set_exception(error)


class MeanSlotHold:
    """How long a request holds its worker slot, on average (an exponential moving average of finished ones):
    what ``Retry-After`` is estimated from."""

    WEIGHT = 0.1  # of the newest sample

    def __init__(self) -> None:
        self.seconds: float | None = None

    def note(self, seconds: float) -> None:
        mean = self.seconds
        self.seconds = seconds if mean is None else mean + self.WEIGHT * (seconds - mean)

    def retry_after_s(self, num_ahead: int, num_slots: int) -> int:
        return estimate_retry_after_s(num_ahead, num_slots, self.seconds)


def estimate_retry_after_s(num_ahead: int, num_slots: int, mean_slot_hold_s: float | None) -> int:
    """Whole seconds until a request that finds ``num_ahead`` requests waiting would likely get a slot.

    ``num_slots`` requests run at once and each holds its slot ``mean_slot_hold_s`` on average, so slots
    free at ``num_slots / mean_slot_hold_s`` per second and the queue ahead drains in
    ``(num_ahead + 1) * mean_slot_hold_s / num_slots``. Unknown service time: 1 s. Clamped to
    [1, ``MAX_RETRY_AFTER_S``] so that clients honour it.
    """
    if not mean_slot_hold_s or mean_slot_hold_s <= 0:
        return 1
    seconds = (num_ahead + 1) * mean_slot_hold_s / max(1, num_slots)
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(seconds)))
