"""Faults seen from the router: disconnects, dead workers, retries, bad frames, timeouts, bad registrations."""

from __future__ import annotations

import os
import threading
import time

import httpx
import msgspec
import openai
import pytest
import zmq

from pipeline.config import PipelineRole
from pipeline.endpoints import router_endpoint
from pipeline.protocol.cluster import (
    FinishCode,
    Heartbeat,
    RegisterAck,
    TokenDelta,
    WorkerLoad,
    decode_router_to_worker,
    encode,
)
from tests.router.fake_worker import held, tokens_script

BODY = {"model": "tiny", "prompt": "Hi", "max_tokens": 30}


def slow_script(served_model, step_s=0.05):
    return tokens_script(served_model.tokenizer.encode("Hello there, how are you? Paris is the capital."), step_s=step_s)


def test_client_disconnect_mid_stream_cancels_on_the_worker(router, served_model):
    worker = router.add_worker(script=slow_script(served_model))
    with httpx.stream("POST", f"{router.url}/v1/completions", json={**BODY, "stream": True}) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
    request_id = msgspec.json.decode(first[len("data: "):])["id"]
    assert worker.wait_for(lambda: request_id in worker.cancels), "no CancelRequest after the client left"
    assert router.metric("tandem_requests_in_flight") == 0


def test_client_disconnect_while_waiting_for_a_full_response_cancels(router):
    worker = router.add_worker(script=held)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=0.3)
    assert worker.wait_for(lambda: worker.requests and worker.requests[0].request_id in worker.cancels)


def test_worker_death_ends_the_stream_with_an_error_and_unreadies(router_factory, served_model):
    router = router_factory(config={"router": {"max_local_prefill_length": 0, "wait_for_worker_s": 0}})
    worker = router.add_worker(script=slow_script(served_model, step_s=0.1))
    assert router.wait_ready(True)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=10)
    stream = client.completions.create(**{**BODY, "stream": True})
    start = time.monotonic()
    with pytest.raises(openai.APIError, match="worker w0, decoding it, was lost"):
        for i, _chunk in enumerate(stream):
            if i == 0:
                worker.stop()  # no more heartbeats, no more tokens
    assert time.monotonic() - start < 3.0
    assert router.wait_ready(False)
    assert router.metric('tandem_worker_up{role="PrefillAndDecode",worker="w0"}') == 0.0
    response = httpx.post(f"{router.url}/v1/completions", json=BODY)
    assert response.status_code == 503


def test_request_without_tokens_is_retried_on_another_worker(router, served_model):
    stuck = router.add_worker("a-stuck", script=held)  # ties go to the lower id: it is picked first
    healthy = router.add_worker("b-healthy", script=slow_script(served_model, step_s=0.005))
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=10)))
    thread.start()
    assert stuck.wait_for(lambda: bool(stuck.requests))
    stuck.stop()
    thread.join(timeout=10)
    response = result["r"]
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"].startswith("Hello there")
    assert healthy.requests[0].request_id == f"{response.json()['id']}~2"
    assert router.metric("tandem_request_retries_total") == 1.0


def test_prefill_worker_death_before_the_first_token_reroutes_the_prefill(router, served_model):
    answer = slow_script(served_model, step_s=0.005)

    def decode_script(request):  # tokens only once the request names the surviving prefill worker
        return answer(request) if request.prefill_worker_id == "p-b" else []

    decode = router.add_worker("d0", role=PipelineRole.DecodeOnly, script=decode_script)
    doomed = router.add_worker("p-a", role=PipelineRole.PrefillOnly, prefill_endpoint="ipc:///tmp/p-a")
    router.add_worker("p-b", role=PipelineRole.PrefillOnly, prefill_endpoint="ipc:///tmp/p-b")
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=10)))
    thread.start()
    assert decode.wait_for(lambda: bool(decode.requests)) and decode.requests[0].prefill_worker_id == "p-a"
    doomed.stop()
    thread.join(timeout=10)
    assert result["r"].status_code == 200, result["r"].text
    first, second = decode.requests
    assert first.request_id in decode.cancels  # the decode worker drops the attempt whose prefill died
    assert second.request_id == first.request_id + "~2" and second.prefill_endpoint == "ipc:///tmp/p-b"


def test_retryable_worker_error_is_retried_elsewhere(router, served_model):
    def reject(request):
        return [(0.0, TokenDelta(request_id=request.request_id, finish_reason=FinishCode.ERROR, error="no KV blocks", retryable=True))]

    router.add_worker("a-full", script=reject)
    router.add_worker("b-ok", script=slow_script(served_model, step_s=0.005))
    response = httpx.post(f"{router.url}/v1/completions", json=BODY)
    assert response.status_code == 200 and response.json()["choices"][0]["text"].startswith("Hello")


def test_a_prefill_side_failure_is_retried_on_the_same_decode_worker_without_that_prefill_worker(router, served_model):
    decode_ok = slow_script(served_model, step_s=0.005)

    def decode_script(request):
        if request.prefill_worker_id == "p-stuck":  # its prefill timed out there: the decode side is fine
            return [(0.0, TokenDelta(request_id=request.request_id, finish_reason=FinishCode.ERROR,
                                     error="prefill timed out", retryable=True, is_prefill_failure=True))]
        return decode_ok(request)

    decode = router.add_worker("d0", role=PipelineRole.DecodeOnly, script=decode_script)
    router.add_worker("p-stuck", role=PipelineRole.PrefillOnly, prefill_endpoint="ipc:///tmp/p-stuck")
    response = httpx.post(f"{router.url}/v1/completions", json=BODY)
    assert response.status_code == 200, response.text  # d0 is the only decode worker, and it is not to blame
    first, second = decode.requests
    assert first.prefill_worker_id == "p-stuck"
    assert second.request_id == first.request_id + "~2" and second.prefill_worker_id is None  # prefilled locally


def test_worker_error_fails_the_request(router):
    def fail(request):
        return [(0.0, TokenDelta(request_id=request.request_id, finish_reason=FinishCode.ERROR, error="KV checksum mismatch"))]

    router.add_worker(script=fail)
    response = httpx.post(f"{router.url}/v1/completions", json=BODY)
    assert response.status_code == 500 and "KV checksum mismatch" in response.json()["error"]["message"]
    assert router.metric('tandem_requests_total{outcome="error"}') == 1


def test_request_deadline(router_factory):
    router = router_factory(request_timeout_s=0.4)
    worker = router.add_worker(script=held)
    response = httpx.post(f"{router.url}/v1/completions", json=BODY)
    assert response.status_code == 504 and response.json()["error"]["type"] == "timeout_error"
    assert worker.wait_for(lambda: worker.requests[0].request_id in worker.cancels)
    assert worker.requests[0].deadline_s <= 0.4


def test_malformed_frames_are_counted_and_dropped(router, served_model):
    worker = router.add_worker(script=slow_script(served_model, step_s=0.001))
    worker.send_raw(b"\xc1 not msgpack")
    worker.send_raw(encode(Heartbeat(worker_id="someone-else", load=WorkerLoad())))
    worker.send_raw(b"two", b"frames")
    worker.send_raw(b"\x91\xa2\xff\xfe")  # a string that is not UTF-8: once it stopped the router's receiving
    deadline = time.monotonic() + 5
    while router.metric("tandem_router_bad_frames_total") < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert router.metric("tandem_router_bad_frames_total") == 4
    time.sleep(1.5)  # longer than dead_after_s: the worker's heartbeats are still heard
    assert httpx.post(f"{router.url}/v1/completions", json=BODY).status_code == 200
    assert router.state.dispatcher.num_bad_frames == 4


def test_registration_is_checked_and_unknown_heartbeats_are_told_to_register(router):
    wrong = router.add_worker("w-wrong", model_name="another-model")
    assert wrong.acks[0].accepted is False and "another-model" in wrong.acks[0].error
    assert router.wait_ready(False, timeout=0.2)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"ghost")
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(router_endpoint(router.base))
        sock.send(encode(Heartbeat(worker_id="ghost", load=WorkerLoad())))
        assert sock.poll(5000)
        ack = decode_router_to_worker(sock.recv())
        assert isinstance(ack, RegisterAck) and not ack.accepted and ack.reregister
    finally:
        sock.close(0)
        ctx.term()
    good = router.add_worker("w-good")
    assert good.acks[0].accepted and good.acks[0].heartbeat_interval_s == 0.05


def test_run_router_process_never_imports_torch(tiny_checkpoint):
    """``run_router`` in a fresh process serves (tokenizing a chat prompt) without torch ever loading."""
    import subprocess
    import sys

    code = f"""
import socket, sys, tempfile, threading, time
import router.app
assert "torch" not in sys.modules and "transformers" not in sys.modules, "importing the router pulled them in"
import httpx
from pipeline.config import PipelineConfig
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
config = PipelineConfig(zmq_endpoint_base="ipc://" + tempfile.mkdtemp(dir="/tmp") + "/t",
                        model={{"model_path": {tiny_checkpoint('llama')!r}}})
threading.Thread(target=router.app.run_router, args=(config, "127.0.0.1", port), daemon=True).start()
url = f"http://127.0.0.1:{{port}}"
for _ in range(300):
    try:
        if httpx.get(url + "/health").status_code == 200:
            break
    except httpx.TransportError:
        time.sleep(0.05)
name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
reply = httpx.post(url + "/v1/chat/completions", json={{"model": name, "messages": [{{"role": "user", "content": "Hi"}}]}})
assert reply.status_code == 503 and "no live workers" in reply.text, reply.text
assert sys.modules.get("torch") is None, "torch was imported"
print("ok", name)
"""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and "ok tiny-llama" in out.stdout, out.stdout[-500:] + out.stderr[-2000:]


def test_a_stream_whose_worker_dies_migrates_and_goes_on(router, served_model):
    ids = served_model.tokenizer.encode("Hello there, how are you? Paris is the capital.")

    def rest(request):  # the new worker goes on after the tokens the client already has
        done = len(request.resume_token_ids)
        assert request.resume_token_ids == ids[:done]
        return tokens_script(ids[done:], step_s=0.005)(request)

    first = router.add_worker("a-first", script=tokens_script(ids, step_s=0.1))  # ties go to the lower id
    second = router.add_worker("b-second", script=rest)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=10)
    text = ""
    for i, chunk in enumerate(client.completions.create(**{**BODY, "max_tokens": len(ids), "stream": True,
                                                           "stream_options": {"include_usage": True}})):
        if chunk.choices:
            text += chunk.choices[0].text
        if i == 2:
            first.stop()  # dies after three tokens: no more heartbeats, no more tokens
        usage = chunk.usage
    assert text == served_model.tokenizer.decode(ids)  # nothing repeated, nothing missing
    assert usage.completion_tokens == len(ids)
    [resumed] = second.requests
    assert 3 <= len(resumed.resume_token_ids) < len(ids) and resumed.request_id.endswith("~2")
    assert router.metric('tandem_migrations_total{cause="worker_died"}') == 1.0
    assert router.metric("tandem_request_retries_total") == 0  # retries are before the first token
    assert router.metric("tandem_migration_recomputed_tokens_total") == len(resumed.prompt_token_ids) + len(
        resumed.resume_token_ids)
    assert router.metric("tandem_migration_pause_seconds_count") == 1.0
    assert router.metric("tandem_migration_pause_seconds_sum") >= 0.5  # at least the silence before it was dead


def loop_lags(router) -> tuple[float, float]:
    """(timer rounds, rounds at most 1 s late) of the router's event-loop lag histogram, from one scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{router.url}/metrics").text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "tandem_router_event_loop_lag_seconds")
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    return samples["tandem_router_event_loop_lag_seconds_count", None], samples[
        "tandem_router_event_loop_lag_seconds_bucket", "1.0"]


def test_a_stalled_router_loop_shows_in_its_lag_metric_and_costs_no_worker(router, caplog):
    """The router's own event loop blocked past dead_after_s (a long synchronous call, a descheduled process): the
    workers' heartbeats wait on its socket, so nobody is declared dead; the stall is in the lag histogram."""
    router.add_worker()
    time.sleep(0.3)
    rounds, on_time = loop_lags(router)
    assert rounds > 0 and on_time == rounds
    loop = router.state.dispatcher._housekeeping.get_loop()
    with caplog.at_level("WARNING", logger="router.registry"):
        loop.call_soon_threadsafe(time.sleep, 1.3)  # dead_after_s is 1.0
        time.sleep(1.6)
    assert router.state.dispatcher.registry.is_alive("w0") and router.wait_ready(True, timeout=0.1)
    assert "this round is skipped" in caplog.text and "declared dead" not in caplog.text
    rounds, on_time = loop_lags(router)
    assert rounds - on_time >= 1  # the late round, in the 1-2.5 s bucket
