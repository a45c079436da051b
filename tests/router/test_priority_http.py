"""``priority`` over HTTP against fake workers: validated on every endpoint, carried to the worker, the
queue served best first, a full queue's worst request displaced (429) by a better one, and the
per-priority metrics."""

from __future__ import annotations

import httpx
import pytest

from tests.router.fake_worker import held
from tests.router.test_admission import REPLY, assert_overloaded, body, finish, in_thread, post, queued, wait_until
from tests.router.test_openai_fields import BASE


@pytest.mark.parametrize("endpoint", list(BASE))
@pytest.mark.parametrize("value", ["1", 1.5, True, 2**63, -2**63 - 1, 10**20])  # (null is the default, 0: elsewhere)
def test_a_priority_not_a_64_bit_integer_is_a_400_naming_it(router, endpoint, value):
    """Past 64 bits it used to pass, wait its turn and fail its dispatch with a 500 (the frame cannot carry it)."""
    response = httpx.post(f"{router.url}{endpoint}", json=dict(BASE[endpoint], priority=value), timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "priority" and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("endpoint", list(BASE))
def test_the_priority_reaches_the_worker(router, served_model, endpoint):
    worker = router.add_worker(script=held)
    request = in_thread(lambda: httpx.post(f"{router.url}{endpoint}", json=dict(BASE[endpoint], priority=-3),
                                           timeout=20))
    wait_until(lambda: len(worker.requests) == 1)
    assert worker.requests[0].priority == -3
    finish(worker, worker.requests[0], served_model.tokenizer.encode(REPLY))
    assert request.join().status_code == 200


def prioritized(prompt: str, priority: int) -> dict:
    return dict(body(prompt, max_tokens=4), priority=priority)


def test_queued_requests_are_dispatched_best_priority_first(router_factory, served_model):
    router = router_factory(max_queued_requests=8)
    assert router.metric('tandem_router_priority_admission_queue_depth{priority="0"}') == 0  # reported idle too
    worker = router.add_worker(script=held, max_batch_size=1)
    running = in_thread(post, router, prioritized("busy", 0))
    wait_until(lambda: len(worker.requests) == 1)
    pending = []
    for i, (prompt, priority) in enumerate([("low one", 10), ("low two", 10), ("mid", 5), ("urgent", 0)]):
        pending.append(in_thread(post, router, prioritized(prompt, priority)))
        wait_until(lambda: queued(router) == i + 1)
    assert router.metric('tandem_router_priority_admission_queue_depth{priority="10+"}') == 2
    assert router.metric('tandem_router_priority_admission_queue_depth{priority="0"}') == 1
    reply = served_model.tokenizer.encode(REPLY)
    for i in range(5):
        wait_until(lambda: len(worker.requests) == i + 1)
        finish(worker, worker.requests[i], reply)
    answers = [running.join(), *(p.join() for p in pending)]
    assert all(a.status == 200 and a.is_complete for a in answers), answers
    order = [served_model.tokenizer.decode(r.prompt_token_ids) for r in worker.requests]
    assert order == ["busy", "urgent", "mid", "low one", "low two"]
    router.wait_idle()
    assert router.metric('tandem_router_priority_admission_queue_depth{priority="10+"}') == 0  # its series goes on
    assert router.metric('tandem_router_priority_admission_wait_seconds_count{priority="10+"}') == 2
    assert router.metric('tandem_router_priority_time_to_first_token_seconds_count{priority="0"}') == 2


def test_a_full_queue_gives_the_worst_waiter_a_429_for_a_better_newcomer(router_factory, served_model):
    router = router_factory(max_queued_requests=2, queue_timeout_s=20.0)
    worker = router.add_worker(script=held, max_batch_size=1)
    running = in_thread(post, router, prioritized("busy", 10))
    wait_until(lambda: len(worker.requests) == 1)
    first = in_thread(post, router, dict(prioritized("first", 10), stream=True))
    wait_until(lambda: queued(router) == 1)
    second = in_thread(post, router, prioritized("second", 10))
    wait_until(lambda: queued(router) == 2)
    assert_overloaded(post(router, prioritized("equal", 10)))  # as good as the worst waiter: turned away
    urgent = in_thread(post, router, prioritized("urgent", 0))
    displaced = second.join()  # the latest of the worst priority gives way, at once
    assert_overloaded(displaced)
    assert "priority" in displaced.error["message"]
    reply = served_model.tokenizer.encode(REPLY)
    for i in range(3):
        wait_until(lambda: len(worker.requests) == i + 1)
        finish(worker, worker.requests[i], reply)
    for answer in (running.join(), urgent.join(), first.join()):
        assert answer.status == 200 and answer.is_complete and answer.text == REPLY, answer
    order = [served_model.tokenizer.decode(r.prompt_token_ids) for r in worker.requests]
    assert order == ["busy", "urgent", "first"]
    router.wait_idle()
    assert router.metric('tandem_router_priority_displaced_total{priority="10+"}') == 1
    assert router.metric('tandem_requests_total{outcome="overloaded"}') == 2
