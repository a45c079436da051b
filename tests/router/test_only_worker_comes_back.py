"""When the only worker that can serve a request dies or drains: streams, queued and new requests wait
``router.wait_for_worker_s`` for it to come back (a restart, a rolling restart's replacement, a frozen worker
heard from again) and go on there; past that wait they fail with a 503, and nothing counts as a migration."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from pipeline.protocol.cluster import WorkerLoad
from tests.router.fake_worker import held, tokens_script
from tests.router.test_admission import in_thread
from tests.router.test_http_faults import BODY, slow_script


ONLY_WORKER_COMES_BACK = {"router": {"max_local_prefill_length": 0, "wait_for_worker_s": 10}}


def test_a_stream_whose_only_worker_dies_goes_on_once_it_restarts(router_factory, served_model):
    """No other worker: the stream pauses until the worker registers again (a new pid, as tandem up restarts it)
    and goes on there; an audit saw every stream fail at once although the restart came a second later."""
    router = router_factory(config=ONLY_WORKER_COMES_BACK)
    ids = served_model.tokenizer.encode("Hello there, how are you? Paris is the capital.")

    def rest(request):
        return tokens_script(ids[len(request.resume_token_ids):], step_s=0.005)(request)

    first = router.add_worker("w0", script=tokens_script(ids, step_s=0.1), pid=1001)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=30)
    text, restarted = "", None
    for i, chunk in enumerate(client.completions.create(**{**BODY, "max_tokens": len(ids), "stream": True})):
        text += chunk.choices[0].text
        if i == 2:
            first.stop()
            assert router.wait_ready(False)  # it is dead, and nobody else can serve the stream
            restarted = router.add_worker("w0", script=rest, pid=1002)
    assert text == served_model.tokenizer.decode(ids)
    assert len(restarted.requests) == 1 and len(restarted.requests[0].resume_token_ids) >= 3
    assert router.metric('tandem_migrations_total{cause="worker_died"}') == 1.0


def test_a_new_request_waits_for_the_replacement_of_the_only_worker_draining_in_a_rolling_restart(
        router_factory, served_model):
    """The one decode worker of a 1P1D cluster drains (SIGHUP, tandem ray restart) and leaves; its replacement
    registers seconds later. Requests arriving meanwhile wait for it, as a retry would: an audit saw 503s (12 of
    111) for those seconds."""
    router = router_factory(config=ONLY_WORKER_COMES_BACK)
    ids = served_model.tokenizer.encode("Paris is")
    old = router.add_worker("w0", script=tokens_script(ids), pid=1001)
    old.load = WorkerLoad(num_free_blocks=64, num_total_blocks=64, is_draining=True)  # it drains
    registry = router.state.dispatcher.registry
    assert old.wait_for(lambda: all(w.load.is_draining for w in registry.all_workers()))
    waiting = in_thread(lambda: httpx.post(f"{router.url}/v1/completions", json={**BODY, "max_tokens": len(ids)},
                                           timeout=30))
    time.sleep(0.3)
    old.stop()  # drained, gone
    time.sleep(1.5)  # silent past dead_after_s: declared dead
    new = router.add_worker("w0", script=tokens_script(ids), pid=1002)  # the replacement
    answer = waiting.join()
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == served_model.tokenizer.decode(ids)
    assert len(new.requests) == 1


def test_queued_requests_wait_for_the_restart_of_the_only_worker_that_died(router_factory, served_model):
    """The one decode worker of a 1P1D cluster crashes with requests queued behind its full batch; its launcher
    restarts it seconds later. The queued requests wait for it (they have no tokens yet, as a retry would) instead
    of a 503 each the moment it is declared dead (an audit: 44 of 44, the worker back 6 s later). Once it was last
    heard of longer than wait_for_worker_s ago, a request nobody can serve is a 503 at once."""
    router = router_factory(config={"router": {"max_local_prefill_length": 0, "wait_for_worker_s": 3}})
    ids = served_model.tokenizer.encode("Paris is")
    post = lambda: httpx.post(f"{router.url}/v1/completions", json={**BODY, "max_tokens": len(ids)},  # noqa: E731
                              timeout=30)
    old = router.add_worker("w0", script=held, max_batch_size=1, pid=1001)
    in_flight = in_thread(post)
    assert old.wait_for(lambda: old.requests)  # the batch is full
    queued = [in_thread(post) for _ in range(3)]
    time.sleep(0.3)
    old.stop()  # it crashed
    assert router.wait_ready(False)  # declared dead
    time.sleep(0.5)  # the queue was pumped with nobody to serve it
    new = router.add_worker("w0", script=tokens_script(ids), pid=1002)  # restarted
    for request in [in_flight, *queued]:
        answer = request.join()
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == served_model.tokenizer.decode(ids)
    new.stop()
    assert router.wait_ready(False)
    time.sleep(3.5)  # past wait_for_worker_s: nothing is due any more
    started = time.monotonic()
    assert post().status_code == 503 and time.monotonic() - started < 2


def test_a_stream_goes_on_on_its_worker_when_that_worker_resumes_after_being_declared_dead(router_factory,
                                                                                        served_model):
    """A worker frozen past dead_after_s (SIGSTOP, a swapped-out host) is declared dead; when it resumes, the same
    process again, it is a new incarnation: the stream that failed there goes on there. An audit saw every such
    stream fail after wait_for_worker_s, excluded by the resumed worker's unchanged pid."""
    router = router_factory(config=ONLY_WORKER_COMES_BACK)
    ids = served_model.tokenizer.encode("Hello there, how are you? Paris is the capital.")

    def script(request):
        return tokens_script(ids[len(request.resume_token_ids):], step_s=0.1 if not request.resume_token_ids
                             else 0.005)(request)

    worker = router.add_worker("w0", script=script, pid=1001)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=30)
    text = ""
    for i, chunk in enumerate(client.completions.create(**{**BODY, "max_tokens": len(ids), "stream": True})):
        text += chunk.choices[0].text
        if i == 2:
            worker.freeze()
            assert router.wait_ready(False)  # declared dead; nobody else can serve the stream
            worker.thaw()
    assert text == served_model.tokenizer.decode(ids)
    assert len(worker.requests) == 2 and len(worker.requests[1].resume_token_ids) >= 3  # again on the same worker
    assert router.state.dispatcher.registry.get("w0").incarnation == 1


def test_a_stream_fails_once_no_worker_came_back_in_time_and_is_no_migration(router_factory, served_model):
    router = router_factory(config={"router": {"max_local_prefill_length": 0, "wait_for_worker_s": 0.5}})
    worker = router.add_worker(script=slow_script(served_model, step_s=0.1))
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=30)
    stream = client.completions.create(**{**BODY, "stream": True})
    with pytest.raises(openai.APIError, match="no worker that can serve it came back in time"):
        for i, _chunk in enumerate(stream):
            if i == 0:
                worker.stop()
    assert router.metric('tandem_migrations_total{cause="worker_died"}') == 0.0  # nothing moved
    assert router.metric('tandem_requests_total{outcome="unavailable"}') == 1  # no worker: not the server's error
    assert router.metric('tandem_requests_total{outcome="error"}') == 0
    router.wait_idle()
