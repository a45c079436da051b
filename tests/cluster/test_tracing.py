"""OpenTelemetry traces from a real 1P1D cluster (``otlp_traces_endpoint``) into an OTLP/HTTP receiver in
this test: a request sent with a client's ``traceparent`` is one trace under the client's span, with the
router's spans, the prefill worker's (queue, compute, KV send) and the decode worker's (queue, KV receive,
decoding), each worker's spans children of the router's request span. max_local_prefill_length 0 (the
cluster fixtures' default): every prompt is prefilled remotely, its KV transferred."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from tests.cluster.conftest import running_cluster
from bench.otlp_receiver import OtlpReceiver

ROUTER_SPANS = {"tandem.request", "router.queue", "router.route"}
PREFILL_SPANS = {"prefill", "prefill.queue", "prefill.compute", "kv_transfer.send"}
DECODE_SPANS = {"decode", "decode.queue", "kv_transfer.receive", "decode.decoding"}


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, tmp_path_factory, receiver):
    # spans leave each process every 100 ms (the SDK's batch delay is 5 s by default)
    # every step that runs a prompt chunk takes 0.3 s more: the prompt's compute is in prefill.compute
    with running_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp("logs-tracing"), num_prefill=1,
                         num_decode=1, config={"otlp_traces_endpoint": receiver.endpoint},
                         entry_module="tests.cluster.slow_steps",
                         env={"OTEL_BSP_SCHEDULE_DELAY": "100", "TANDEM_TEST_SLOW_STEP_S": "0.3",
                              "TANDEM_TEST_SLOW_MIN_CHUNK": "4"}) as cluster:
        yield cluster


def _complete(cluster, headers: dict | None = None) -> dict:
    response = httpx.post(f"{cluster.url}/v1/completions", headers=headers, timeout=60, json={
        "model": os.path.basename(cluster.model_path), "prompt": "Paged attention keeps the cache in blocks",
        "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_client_traceparent_yields_one_trace_across_router_prefill_transfer_and_decode(cluster, receiver):
    trace_id, client_span_id = os.urandom(16).hex(), os.urandom(8).hex()
    body = _complete(cluster, {"traceparent": f"00-{trace_id}-{client_span_id}-01"})
    spans = receiver.wait_for(trace_id, ROUTER_SPANS | PREFILL_SPANS | DECODE_SPANS)
    by_name = {s.name: s for s in spans}
    assert ROUTER_SPANS | PREFILL_SPANS | DECODE_SPANS <= set(by_name), sorted(by_name)

    request = by_name["tandem.request"]
    assert request.parent_span_id == client_span_id  # the router's span is the client span's child
    assert request.service == "tandem-router" and request.attributes["tandem.request_id"] == body["id"]
    prefill, decode = by_name["prefill"], by_name["decode"]
    assert (prefill.service, prefill.worker_id) == ("tandem-prefill", "prefill-0")
    assert (decode.service, decode.worker_id) == ("tandem-decode", "decode-0")
    for name in ("router.queue", "router.route", "prefill", "decode"):
        assert by_name[name].parent_span_id == request.span_id, name
    for name in PREFILL_SPANS - {"prefill"}:
        assert by_name[name].parent_span_id == prefill.span_id, name
    for name in DECODE_SPANS - {"decode"}:
        assert by_name[name].parent_span_id == decode.span_id, name

    route = by_name["router.route"].attributes
    assert route["tandem.decode_worker"] == "decode-0" and route["tandem.prefill_worker"] == "prefill-0"
    assert "tandem.route.decode_cost" in route and "tandem.route.prefill_cached_blocks" in route
    sent, received = by_name["kv_transfer.send"].attributes, by_name["kv_transfer.receive"].attributes
    assert sent["tandem.kv.ok"] and received["tandem.kv.ok"]
    assert sent["tandem.kv.num_bytes"] == received["tandem.kv.num_bytes"] > 0
    assert sent["tandem.kv.transport"] == received["tandem.kv.transport"] in ("shm", "zmq")
    assert sent["tandem.kv.num_blocks"] >= 1
    decoding = by_name["decode.decoding"]
    assert decoding.attributes["tandem.num_output_tokens"] == body["usage"]["completion_tokens"] == 6
    assert decoding.attributes["tandem.num_preemptions"] == 0
    assert by_name["prefill.compute"].attributes["tandem.num_prompt_tokens"] == body["usage"]["prompt_tokens"]
    # one clock on one host: the stages follow each other
    assert request.start_ns <= prefill.start_ns and request.start_ns <= decode.start_ns
    queue, compute = by_name["prefill.queue"], by_name["prefill.compute"]
    assert queue.end_ns == compute.start_ns  # the step that ran the prompt is compute, not queueing
    assert compute.end_ns - compute.start_ns >= 0.3e9 > queue.end_ns - queue.start_ns
    assert by_name["decode.queue"].end_ns <= by_name["kv_transfer.receive"].end_ns <= decoding.start_ns
    assert decoding.end_ns <= request.end_ns


def test_a_request_without_traceparent_starts_its_own_trace(cluster, receiver):
    body = _complete(cluster)
    roots = []
    for _ in range(100):
        roots = [s for s in receiver.spans
                 if s.name == "tandem.request" and s.attributes.get("tandem.request_id") == body["id"]]
        if roots:
            break
        time.sleep(0.05)
    assert len(roots) == 1 and roots[0].parent_span_id == ""
    spans = receiver.wait_for(roots[0].trace_id, PREFILL_SPANS | DECODE_SPANS)
    assert PREFILL_SPANS | DECODE_SPANS <= {s.name for s in spans}
