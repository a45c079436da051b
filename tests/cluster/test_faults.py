"""Faults on a real 2 prefill + 2 decode cluster: disconnects, garbage frames, kill -9 of workers.

Ordered from harmless to destructive; the cluster is shared by the module, so the kill tests run last.
"""

from __future__ import annotations

import http.client
import signal
from pathlib import Path
import threading
import time

import httpx
import openai
import pytest
import zmq

from kv_transfer.shm_files import shared_kv_files_of
from pipeline.endpoints import router_endpoint, worker_bind_endpoint
from tests.cluster.conftest import (CLUSTER_CONFIG, kv_gauges, migrations, start_cluster, wait_for_idle_blocks,
                                    worker_metric)

NUM_BLOCKS = CLUSTER_CONFIG["kv_cache"]["num_blocks"]
FAST_FAULTS = {"transfer": {"transport": "shm", "ttl_s": 3.0, "heartbeat_interval_s": 0.2}}


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, tmp_path_factory):
    # A 3 ms pause per step: the tiny model's 1,500-token streams stay in flight for seconds, so the
    # kill tests hit them mid-stream however fast the machine is.
    c = start_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp("logs-faults"), num_prefill=2,
                      num_decode=2, config=FAST_FAULTS, entry_module="tests.cluster.slow_steps",
                      env={"TANDEM_TEST_STEP_DELAY_S": "0.003"})
    try:
        yield c
    finally:
        c.stop()
    leftovers = shared_kv_files_of(c.started_pids)  # this cluster's only: others may run on the host
    assert not leftovers, f"a shared KV cache outlived the cluster: {leftovers}"


def name(client) -> str:
    return client.models.list().data[0].id


def long_stream(client, prompt: str = "Once upon a time"):
    return client.completions.create(model=name(client), prompt=prompt, max_tokens=1500, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})


def used_blocks(url: str, worker: str) -> float:
    return kv_gauges(url)[("tandem_kv_blocks_used", worker)]


def test_an_idle_keep_alive_connection_stays_open_past_a_clients_idle_timeout(cluster):
    """A client pools connections for 5 s (httpx, the openai SDK): the router keeps them longer
    (router.http_keep_alive_s), so a request sent on a pooled connection is never one the router was
    closing at that moment (a ReadError the client cannot tell from a failure)."""
    url = httpx.URL(cluster.url)
    connection = http.client.HTTPConnection(url.host, url.port, timeout=10)
    try:
        sockets = []
        for attempt in range(2):
            if attempt:
                time.sleep(6.0)  # idle past the clients' 5 s (and uvicorn's own default)
            connection.request("GET", "/v1/models")
            response = connection.getresponse()  # RemoteDisconnected had the router closed it meanwhile
            assert response.status == 200 and response.getheader("connection") != "close"
            response.read()
            sockets.append(connection.sock)
        assert sockets[0] is sockets[1]  # the same connection served both
    finally:
        connection.close()


def test_client_disconnect_frees_decode_blocks_within_1s(cluster, client):
    stream = long_stream(client)
    busy: list[str] = []
    started = time.monotonic()
    for _chunk in stream:  # keep reading until a heartbeat shows the blocks this stream holds
        busy = [w for w in ("decode-0", "decode-1") if used_blocks(cluster.url, w) > 0]
        if busy or time.monotonic() - started > 5:
            break
    assert busy, "the stream should hold KV blocks on a decode worker"
    stream.close()
    closed_at = time.monotonic()
    while any(used_blocks(cluster.url, w) > 0 for w in busy):
        assert time.monotonic() - closed_at < 1.0 + 0.2 + 0.3  # 1 s, plus one heartbeat and one scrape
        time.sleep(0.05)
    wait_for_idle_blocks(cluster.url, cluster.worker_names, NUM_BLOCKS)


def test_malformed_frames_are_counted_and_dropped(cluster, client):
    base = cluster.config["zmq_endpoint_base"]
    targets = [router_endpoint(base), incarnation_endpoint(base, "prefill-0", "prefill"),
               incarnation_endpoint(base, "decode-0", "kv")]
    ctx = zmq.Context()
    try:
        for endpoint in targets:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.IDENTITY, b"intruder")
            sock.connect(endpoint)
            sock.send(b"\xc1 not msgpack at all")
            sock.send_multipart([b"\x93\x01\x02", b"two frames"])
            sock.close()
    finally:
        ctx.term()
    deadline = time.monotonic() + 5
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(f"{cluster.url}/metrics").text
        counts = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith(("tandem_worker_bad_frames_total{", "tandem_router_bad_frames_total"))
                  and "{" in line}
        if all(any(w in labels and value > 0 for labels, value in counts.items()) for w in ("prefill-0", "decode-0")):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"bad frames not reported:\n{text}")
    out = client.completions.create(model=name(client), prompt="still serving?", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")


def incarnation_endpoint(base: str, worker_id: str, name: str) -> str:
    """A worker's ipc endpoint ``name`` of its running incarnation (the name ends with its pid)."""
    prefix = worker_bind_endpoint(base, worker_id, name)[len("ipc://"):]
    [path] = Path(prefix).parent.glob(Path(prefix).name + "-*")
    return f"ipc://{path}"


def _consume_until_end(stream, results: dict, key: str) -> None:
    started = time.monotonic()
    try:
        for _ in stream:
            results.setdefault(key + ":first", time.monotonic())
        results[key] = ("completed", time.monotonic())
    except (openai.APIError, httpx.HTTPError) as exc:
        results[key] = ("error", time.monotonic(), repr(exc))
    results[key + ":started"] = started


def test_kill_decode_worker_mid_stream(cluster, client):
    streams = [long_stream(client, f"story number {i}") for i in range(4)]
    results: dict = {}
    threads = [threading.Thread(target=_consume_until_end, args=(s, results, str(i)), daemon=True)
               for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while sum(k.endswith(":first") for k in results) < 4:  # every stream has tokens: none can be retried
        assert time.monotonic() < deadline and not any(":" not in k for k in results), results
        time.sleep(0.02)
    time.sleep(0.3)  # a heartbeat with the blocks
    assert used_blocks(cluster.url, "decode-0") > 0 and used_blocks(cluster.url, "decode-1") > 0
    running = worker_metric(cluster.url, "tandem_worker_running_requests", "decode-0") or 0
    cluster.kill("decode-0", signal.SIGKILL)
    killed_at = time.monotonic()
    # no stream ends: those on decode-0 migrate to decode-1 (which recomputes what they had) and go on
    while migrations(cluster.url) < running:
        assert time.monotonic() - killed_at < 10.0, f"the killed worker's streams did not move: {results}"
        time.sleep(0.1)
    time.sleep(1.0)
    assert not [v for k, v in results.items() if ":" not in k and v[0] == "error"], f"a stream failed: {results}"
    assert httpx.get(f"{cluster.url}/ready").status_code == 200
    for stream in streams:  # the survivors' client goes away: their blocks must come back too
        stream.close()
    for t in threads:
        t.join(timeout=10)
    out = client.completions.create(model=name(client), prompt="after the crash", max_tokens=8, temperature=0)
    assert out.usage.completion_tokens > 0
    wait_for_idle_blocks(cluster.url, ["prefill-0", "prefill-1", "decode-1"], NUM_BLOCKS, timeout_s=20)


def test_kill_prefill_worker_mid_traffic(cluster, client):
    results: dict = {}
    prompts = [f"a somewhat longer prompt that takes a few chunks to prefill, number {i}" * 3 for i in range(12)]

    def one(i):
        try:
            out = client.completions.create(model=name(client), prompt=prompts[i], max_tokens=32, temperature=0,
                                            extra_body={"ignore_eos": True})
            results[i] = ("ok", out.usage.completion_tokens)
        except openai.APIError as exc:
            results[i] = ("error", repr(exc))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(12)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    cluster.kill("prefill-0", signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 12 and time.monotonic() - killed_at < 30
    assert all(r[0] in ("ok", "error") for r in results.values())
    assert httpx.get(f"{cluster.url}/ready").status_code == 200
    for _ in range(3):  # new requests succeed on the surviving pair
        out = client.completions.create(model=name(client), prompt="after the prefill crash", max_tokens=8,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 8
    wait_for_idle_blocks(cluster.url, ["prefill-1", "decode-1"], NUM_BLOCKS, timeout_s=20)
