"""The admission queue alone: FIFO order, bound, timeout, cancellation, failures of one waiter."""

from __future__ import annotations

import asyncio

import pytest

from router.admission import MAX_RETRY_AFTER_S, AdmissionQueue, Overloaded, estimate_retry_after_s
from router.policy import NoRoute


class Slots:
    """A stand-in for the dispatcher: ``num_free`` slots; admitting takes one and records the item."""

    def __init__(self, num_free: int = 0) -> None:
        self.num_free = num_free
        self.admitted: list[str] = []
        self.unservable: set[str] = set()
        self.num_tries = 0

    def try_admit(self, item: str) -> bool:
        self.num_tries += 1
        if item in self.unservable:
            raise NoRoute(f"nobody can serve {item}")
        if self.num_free <= 0:
            return False
        self.num_free -= 1
        self.admitted.append(item)
        return True

    def free(self, queue: AdmissionQueue, num: int = 1) -> None:
        self.num_free += num
        queue.wake()


async def turn() -> None:
    """Let scheduled callbacks (the queue's pass, done callbacks) run."""
    for _ in range(3):
        await asyncio.sleep(0)


def run(coro):
    return asyncio.run(coro)


def test_a_free_slot_admits_at_once_without_queueing():
    async def main():
        slots = Slots(num_free=1)
        queue = AdmissionQueue(slots.try_admit, max_queued_requests=0, queue_timeout_s=1.0)
        future = queue.enqueue("a")
        assert future.done() and future.result() is None and len(queue) == 0
        assert slots.admitted == ["a"]

    run(main())


def test_waiters_are_admitted_in_arrival_order_and_newcomers_do_not_overtake():
    async def main():
        slots = Slots()
        queue = AdmissionQueue(slots.try_admit, max_queued_requests=8, queue_timeout_s=5.0)
        futures = {name: queue.enqueue(name) for name in "abc"}
        assert len(queue) == 3 and not any(f.done() for f in futures.values())
        slots.num_free = 1  # a slot frees but nobody woke the queue yet: a newcomer must still queue
        futures["d"] = queue.enqueue("d")
        await turn()
        assert slots.admitted == ["a"] and futures["a"].done() and len(queue) == 3
        slots.free(queue, 2)
        await turn()
        assert slots.admitted == ["a", "b", "c"] and len(queue) == 1
        slots.free(queue)
        await turn()
        assert slots.admitted == ["a", "b", "c", "d"] and len(queue) == 0

    run(main())


def test_a_full_queue_overloads_at_once():
    async def main():
        slots = Slots()
        queue = AdmissionQueue(slots.try_admit, max_queued_requests=2, queue_timeout_s=5.0)
        queue.enqueue("a"), queue.enqueue("b")
        with pytest.raises(Overloaded, match="queue is full"):
            queue.enqueue("c")
        assert len(queue) == 2
        no_queue = AdmissionQueue(slots.try_admit, max_queued_requests=0, queue_timeout_s=5.0)
        with pytest.raises(Overloaded):
            no_queue.enqueue("x")
        queue.close(NoRoute("test over"))

    run(main())


def test_waiting_past_the_timeout_overloads_and_leaves_the_queue():
    async def main():
        slots = Slots()
        queue = AdmissionQueue(slots.try_admit, max_queued_requests=4, queue_timeout_s=0.05)
        slow = queue.enqueue("a")
        short = queue.enqueue("b", timeout_s=0.01)  # its own deadline comes first
        with pytest.raises(Overloaded, match="0.01 s"):
            await short
        with pytest.raises(Overloaded, match="0.05 s"):
            await slow
        assert len(queue) == 0
        slots.free(queue)
        await turn()
        assert slots.admitted == []

    run(main())


def test_a_cancelled_waiter_leaves_the_queue_and_takes_no_slot():
    async def main():
        slots = Slots()
        queue = AdmissionQueue(slots.try_admit, max_queued_requests=4, queue_timeout_s=5.0)
        async def wait_admitted(item):  # what the HTTP handler does: await the future enqueue returned
            await queue.enqueue(item)

        waiting = asyncio.ensure_future(wait_admitted("a"))
        queue.enqueue("b")
        await turn()
        assert len(queue) == 2
        waiting.cancel()
        await turn()
        assert len(queue) == 1 and "a" not in queue
        slots.free(queue)
        await turn()
        assert slots.admitted == ["b"]
        queue.discard("nobody")  # not queued: nothing happens

    run(main())


def test_at_front_goes_ahead_of_everyone_and_past_the_bound():
    async def main():
        slots = Slots()
        queue = AdmissionQueue(slots.try_admit, max_queued_requests=1, queue_timeout_s=5.0)
        queue.enqueue("a")
        retry = queue.enqueue("retry", at_front=True)
        assert len(queue) == 2 and not retry.done()
        slots.free(queue)
        await turn()
        assert slots.admitted == ["retry"] and retry.done()
        slots.num_free = 1
        assert queue.enqueue("retry2", at_front=True).done()  # a free slot: admitted at once, even past others
        queue.close(NoRoute("test over"))

    run(main())


def test_an_unservable_waiter_fails_alone_and_the_rest_go_on():
    async def main():
        slots = Slots()
        queue = AdmissionQueue(slots.try_admit, max_queued_requests=4, queue_timeout_s=5.0)
        doomed, fine = queue.enqueue("doomed"), queue.enqueue("fine")
        slots.unservable.add("doomed")
        slots.free(queue)
        await turn()
        with pytest.raises(NoRoute, match="doomed"):
            await doomed
        assert fine.done() and slots.admitted == ["fine"]
        slots.num_free = 1
        with pytest.raises(NoRoute):  # on the fast path the error comes at once, nothing queued
            queue.enqueue("doomed")
        assert len(queue) == 0

    run(main())


def test_wake_ups_are_coalesced_into_one_pass():
    async def main():
        slots = Slots()
        queue = AdmissionQueue(slots.try_admit, max_queued_requests=4, queue_timeout_s=5.0)
        queue.enqueue("a")
        await turn()
        tries = slots.num_tries
        for _ in range(50):
            queue.wake()
        await turn()
        assert slots.num_tries == tries + 1
        queue.close(NoRoute("test over"))

    run(main())


def test_close_fails_every_waiter():
    async def main():
        queue = AdmissionQueue(Slots().try_admit, max_queued_requests=4, queue_timeout_s=5.0)
        futures = [queue.enqueue(name) for name in "ab"]
        queue.close(NoRoute("shutting down"))
        for future in futures:
            with pytest.raises(NoRoute, match="shutting down"):
                await future
        assert len(queue) == 0

    run(main())


def test_retry_after_estimate():
    assert estimate_retry_after_s(0, 4, None) == 1  # nothing measured yet
    assert estimate_retry_after_s(0, 4, 0.2) == 1  # never below a second
    assert estimate_retry_after_s(9, 2, 1.0) == 5  # 10 requests through 2 slots of 1 s each
    assert estimate_retry_after_s(1000, 1, 10.0) == MAX_RETRY_AFTER_S  # clients ignore longer delays
    assert estimate_retry_after_s(3, 0, 1.0) == 4  # unknown slot count: as if one


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_queued_requests"):
        AdmissionQueue(Slots().try_admit, max_queued_requests=-1, queue_timeout_s=1.0)
    with pytest.raises(ValueError, match="queue_timeout_s"):
        AdmissionQueue(Slots().try_admit, max_queued_requests=1, queue_timeout_s=0)


def test_uncounted_entries_wait_in_order_past_the_bound():
    """A request's further prompts (``counted=False``) queue behind the bound, in order; counted ones still
    find it full."""
    async def main():
        slots = Slots()
        queue = AdmissionQueue(slots.try_admit, max_queued_requests=1, queue_timeout_s=5.0)
        futures = [queue.enqueue("a0")] + [queue.enqueue(f"a{i}", counted=False) for i in range(1, 4)]
        assert len(queue) == 4
        with pytest.raises(Overloaded, match="queue is full"):
            queue.enqueue("b0")
        slots.free(queue, 4)
        await turn()
        assert slots.admitted == ["a0", "a1", "a2", "a3"] and all(f.done() for f in futures)
        queue.enqueue("c0")  # the bound counts what waits now: a0 left, so c0 finds room
        with pytest.raises(Overloaded):
            queue.enqueue("d0")
        queue.close(NoRoute("test over"))

    run(main())
