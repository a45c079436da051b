"""The order of the router's admission queue: who is admitted next, and who gives way when it is full.

Requests admitted once and queued again (a retry, a migration: ``at_front``) come first, the latest of them
first, as before priorities. Everyone else waits by (priority, arrival): vLLM's ``priority``, lower first,
then first come first served, so with every priority 0 (the default) the line is first in, first out.
The last in line is the worst new request: the one a better newcomer displaces when the queue is full.
Queues are short (``max_queued_requests``, 256 by default), so a sorted list does.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Callable, Generic, Iterator, TypeVar

W = TypeVar("W")

_AT_FRONT, _NEW = 0, 1


class WaitingLine(Generic[W]):
    """Waiters in admission order (``add`` places one by its priority)."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, int, int]] = []
        self._waiters: list[W] = []
        self._priorities: list[int] = []
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._waiters)

    def __iter__(self) -> Iterator[W]:
        return iter(list(self._waiters))

    def add(self, waiter: W, priority: int, *, at_front: bool = False) -> None:
        arrival = next(self._arrivals)
        key = (_AT_FRONT, 0, -arrival) if at_front else (_NEW, priority, arrival)
        index = bisect.bisect_right(self._keys, key)
        self._keys.insert(index, key)
        self._waiters.insert(index, waiter)
        self._priorities.insert(index, priority)

    def head(self) -> W:
        return self._waiters[0]

    def at(self, index: int) -> W:
        """The waiter ``index`` places from the head."""
        return self._waiters[index]

    def remove(self, waiter: W) -> bool:
        """Take ``waiter`` out; False when it was not in line."""
        for index, other in enumerate(self._waiters):
            if other is waiter:
                del self._keys[index], self._waiters[index], self._priorities[index]
                return True
        return False

    def displaceable_by(self, priority: int) -> W | None:
        """The last new request in line when its priority is worse (higher) than ``priority``; else None
        (equal priorities never displace: first come, first served among them)."""
        if not self._keys:
            return None
        kind, worst, _ = self._keys[-1]
        return self._waiters[-1] if kind == _NEW and worst > priority else None

    def count_by(self, label: Callable[[int], str]) -> dict[str, int]:
        """How many wait, per ``label(priority)`` (requests queued again count under theirs too)."""
        counts: dict[str, int] = {}
        for priority in self._priorities:
            counts[label(priority)] = counts.get(label(priority), 0) + 1
        return counts
