"""Where a sequence goes in the scheduler's queues, by ``scheduling_policy`` (vLLM's names and semantics).

The scheduler keeps each queue in service order and reads it the same way under both policies: it admits
from the head of ``waiting`` (and ``waiting_remote``) and preempts from the tail of ``running``. Only where
a sequence is placed differs:

* ``fcfs`` (the default): arrival order. A new request joins the back; a preempted one goes back to the
  front of the waiting queue; ``running`` is in admission order, so the latest admitted is preempted first.
* ``priority``: every queue sorted by ``(priority, arrival)``, lower first (a request's ``priority``: lower
  is served first, default 0; ``arrival`` breaks ties first come first served). The best waiting request is
  admitted next, the worst running one (highest priority value, latest arrival) is preempted first, and a
  preempted request waits in its place by that key (ahead of later arrivals of its priority).

Priority only orders admission and picks preemption victims; it never preempts a running request to
admit a better one (nor does vLLM's v1 scheduler): a better request waits for the next free room.
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from typing import Union

from pipeline.sequence import Sequence

Queue = Union[deque, list]  # of Sequence


class SchedulingPolicy(str, enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


def priority_key(seq: Sequence) -> tuple[int, int]:
    """Service order under ``priority``: lower first."""
    return seq.priority, seq.arrival


class QueueOrder:
    """Places sequences in a scheduler queue (``waiting``, ``waiting_remote``: deques; ``running``: a list)."""

    def __init__(self, policy: SchedulingPolicy | str = SchedulingPolicy.FCFS) -> None:
        self.policy = SchedulingPolicy(policy)
        self.num_arrivals = 0

    def arrive(self, seq: Sequence) -> None:
        """Stamp a new request's arrival (a further choice of a request inherits its parent's)."""
        seq.arrival = self.num_arrivals
        self.num_arrivals += 1

    def push(self, queue: Queue, seq: Sequence) -> None:
        """A new arrival (waiting queues) or a sequence that starts or resumes running: the back under fcfs."""
        if self.policy is SchedulingPolicy.FCFS:
            queue.append(seq)
        else:
            self._insert_sorted(queue, seq)

    def push_back_waiting(self, queue: deque, seq: Sequence) -> None:
        """A request admitted once that waits again (preempted, a further choice without room): the front
        under fcfs, its place by (priority, arrival) under priority."""
        if self.policy is SchedulingPolicy.FCFS:
            queue.appendleft(seq)
        else:
            self._insert_sorted(queue, seq)

    @staticmethod
    def _insert_sorted(queue: Queue, seq: Sequence) -> None:
        # after every sequence of an equal key: equal keys keep the order they came in
        queue.insert(bisect.bisect_right(queue, priority_key(seq), key=priority_key), seq)
