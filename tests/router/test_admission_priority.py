"""The admission queue by priority: (priority, arrival) order, retries first, and who gives way when full."""

from __future__ import annotations

import pytest

from router.admission import AdmissionQueue, Displaced, Overloaded
from router.priority_metrics import priority_label
from tests.router.test_admission_queue import Slots, run, turn


def admitted_order(entries: list[tuple[str, int]]) -> list[str]:
    async def main():
        slots = Slots()
        queue = AdmissionQueue(slots.try_admit, max_queued_requests=16, queue_timeout_s=5.0)
        for name, priority in entries:
            queue.enqueue(name, priority=priority)
        slots.free(queue, len(entries))
        await turn()
        return slots.admitted

    return run(main())


def test_all_default_priorities_stay_first_in_first_out():
    assert admitted_order([(name, 0) for name in "abcde"]) == list("abcde")


def test_lower_priority_first_then_arrival():
    assert admitted_order([("a", 5), ("b", 0), ("c", 5), ("d", -2), ("e", 0)]) == ["d", "b", "e", "a", "c"]


def test_a_retry_goes_ahead_of_every_priority():
    async def main():
        slots = Slots()
        queue = AdmissionQueue(slots.try_admit, max_queued_requests=4, queue_timeout_s=5.0)
        queue.enqueue("best", priority=-10)
        queue.enqueue("retry", at_front=True, priority=50)
        slots.free(queue, 2)
        await turn()
        assert slots.admitted == ["retry", "best"]

    run(main())


def full_queue(slots: Slots, priorities: list[int]) -> tuple[AdmissionQueue, dict]:
    queue = AdmissionQueue(slots.try_admit, max_queued_requests=len(priorities), queue_timeout_s=5.0)
    futures = {f"p{priority}-{i}": queue.enqueue(f"p{priority}-{i}", priority=priority)
               for i, priority in enumerate(priorities)}
    return queue, futures


def test_a_better_newcomer_displaces_the_worst_latest_waiter_which_gets_a_429():
    async def main():
        slots = Slots()
        queue, futures = full_queue(slots, [10, 10, 3])
        newcomer = queue.enqueue("new", priority=0)
        assert len(queue) == 3
        victim = futures["p10-1"]  # the worst priority, and the latest of it
        assert victim.done() and isinstance(victim.exception(), Displaced)
        assert isinstance(victim.exception(), Overloaded)  # the HTTP layer's 429
        assert not any(f.done() for name, f in futures.items() if name != "p10-1")
        slots.free(queue, 3)
        await turn()
        assert slots.admitted == ["new", "p3-2", "p10-0"] and newcomer.result() is None

    run(main())


@pytest.mark.parametrize("priority", [3, 7])
def test_a_newcomer_no_better_than_the_worst_waiter_is_turned_away(priority):
    async def main():
        slots = Slots()
        queue, futures = full_queue(slots, [1, 3])
        with pytest.raises(Overloaded) as caught:
            queue.enqueue("new", priority=priority)
        assert not isinstance(caught.value, Displaced)
        assert len(queue) == 2 and not any(f.done() for f in futures.values())

    run(main())


def test_a_request_queued_again_after_admission_is_never_displaced():
    async def main():
        slots = Slots()
        queue = AdmissionQueue(slots.try_admit, max_queued_requests=1, queue_timeout_s=5.0)
        retry = queue.enqueue("streaming", at_front=True, priority=10)  # its response may have started
        with pytest.raises(Overloaded):
            queue.enqueue("new", priority=0)
        assert not retry.done() and len(queue) == 1

    run(main())


def test_depth_by_priority_counts_each_bucket():
    async def main():
        slots = Slots()
        queue, _ = full_queue(slots, [0, 0, 4, 12, 99, -1])
        assert queue.depth_by_priority(priority_label) == {"0": 2, "4": 1, "10+": 2, "negative": 1}

    run(main())


def test_priority_labels_are_bounded():
    labels = {priority_label(p) for p in range(-1000, 1000)}
    assert labels == {"negative", "10+", *(str(i) for i in range(10))}
