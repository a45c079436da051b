"""A keyed cluster on tcp:// loopback admits no stranger: real processes, a rogue pyzmq process, tcpdump."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from pipeline.security import generate_cluster_key
from tests.cluster.conftest import free_port, model_name, openai_client, running_cluster, wait_for_metric
from tests.security.probe import listening_endpoints, metric_total, rogue_command, rogue_replies

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The vault combination is swordfish marmalade quixotic zebra"


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("keys")
    return {"ours": str(generate_cluster_key(base / "ours")), "theirs": str(generate_cluster_key(base / "theirs"))}


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, tmp_path_factory, keys):
    config = {"zmq_endpoint_base": f"tcp://127.0.0.1:{free_port()}", "security": {"cluster_key_file": keys["ours"]},
              "transfer": {"transport": "zmq"}}  # KV over tcp too, not shared memory
    with running_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp("keyed"), config=config) as cluster:
        yield cluster


def _worker_endpoints(cluster) -> list[str]:
    """Every tcp socket the workers listen on (their start-up log line)."""
    return listening_endpoints((cluster.log_path(name).read_text() for name in cluster.worker_names), r"127\.0\.0\.1")


def test_rogue_without_the_key_achieves_nothing(cluster, keys):
    """No key, or another cluster's: it never registers, no request or KV reaches a worker, nothing answers
    it, the refusals are counted, and the users' requests all succeed meanwhile."""
    client = openai_client(cluster)
    model = model_name(client)
    endpoints = _worker_endpoints(cluster)
    assert len(endpoints) >= 2, endpoints  # the prefill worker's request socket and the KV receiver at least
    refused_before = metric_total(cluster.url, "tandem_cluster_handshakes_refused_total")
    rogues = [subprocess.Popen(rogue_command(cluster.config["zmq_endpoint_base"], endpoints, model, 4, key_file),
                               cwd=ROOT, stdout=subprocess.PIPE, text=True) for key_file in (None, keys["theirs"])]
    failures, answers = [], []

    def users() -> None:
        while any(r.poll() is None for r in rogues):
            try:
                out = client.completions.create(model=model, prompt="Hello there", max_tokens=4)
                answers.append(out.choices[0].text)
            except Exception as exc:  # noqa: BLE001 - counted: the test wants none
                failures.append(exc)

    user_thread = threading.Thread(target=users)
    user_thread.start()
    replies = [rogue_replies(r.communicate(timeout=60)[0]) for r in rogues]
    user_thread.join(60)
    assert replies == [0, 0]
    assert not failures and answers
    ready = httpx.get(f"{cluster.url}/ready", timeout=5).json()
    assert {w["worker_id"] for w in ready["workers"]} == {"prefill-0", "decode-0"}
    assert metric_total(cluster.url, "tandem_cluster_handshakes_refused_total") > refused_before
    assert metric_total(cluster.url, "tandem_worker_bad_frames_total") == 0  # not one frame of theirs got in
    assert metric_total(cluster.url, "tandem_router_bad_frames_total") == 0
    for name in cluster.worker_names:
        assert "refused a cluster handshake" in cluster.log_path(name).read_text(), name
        # the worker's own refusals reach the router's /metrics with its heartbeat
        assert wait_for_metric(cluster.url, "tandem_worker_handshakes_refused_total", name, 0), name


def test_loopback_capture_holds_no_prompt(cluster, tmp_path):
    """tcpdump on lo while a request runs: the cluster's traffic (every port but HTTP's) holds neither the
    prompt's text nor its token ids as msgpack; the HTTP side, captured the same way, does hold the text."""
    tcpdump = shutil.which("tcpdump")
    if tcpdump is None:
        pytest.skip("tcpdump is not installed (apt-get install -y tcpdump)")
    client = openai_client(cluster)
    http_port = cluster.port
    ids = httpx.post(f"{cluster.url}/tokenize", json={"model": model_name(client), "prompt": PROMPT},
                     timeout=10).json()["tokens"]
    captures = {"cluster": tmp_path / "cluster.pcap", "http": tmp_path / "http.pcap"}
    filters = {"cluster": f"tcp and not port {http_port}", "http": f"tcp port {http_port}"}
    dumps = {}
    try:
        for side, path in captures.items():
            dumps[side] = subprocess.Popen([tcpdump, "-i", "lo", "-U", "--immediate-mode", "-s", "0", "-w", str(path),
                                            filters[side]],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for dump in dumps.values():  # tcpdump says "listening on lo" once its capture is open
            said = _wait_listening(dump)
            if "listening on" not in said:
                pytest.skip(f"tcpdump cannot capture here: {said[-300:]!r}")
        time.sleep(0.2)
        out = client.completions.create(model=model_name(client), prompt=PROMPT, max_tokens=8, temperature=0)
        time.sleep(0.5)
    finally:
        for dump in dumps.values():
            dump.send_signal(signal.SIGINT)
            dump.wait(10)
    cluster_bytes, http_bytes = captures["cluster"].read_bytes(), captures["http"].read_bytes()
    assert PROMPT.encode() in http_bytes  # the capture sees what crosses loopback in the clear
    assert len(cluster_bytes) > 2000  # the request crossed the cluster sockets (router, prefill, KV)
    assert PROMPT.encode() not in cluster_bytes
    assert msgspec.msgpack.encode(ids)[1:] not in cluster_bytes  # the ids as GenerateRequest would carry them
    answer = out.choices[0].text.encode()
    if len(answer.strip()) >= 12:  # a short answer could turn up anywhere by chance
        assert answer not in cluster_bytes


def _wait_listening(dump: subprocess.Popen, timeout_s: float = 30.0) -> str:
    said = b""
    deadline = time.monotonic() + timeout_s
    while b"listening on" not in said and time.monotonic() < deadline and dump.poll() is None:
        if select.select([dump.stderr], [], [], 0.2)[0]:
            said += os.read(dump.stderr.fileno(), 4096)
    return said.decode(errors="replace")


def test_tcp_process_without_a_key_refuses_to_start(tiny_checkpoint):
    """Secure by default: every per-role process refuses a tcp:// base with no key, naming the fix;
    --insecure-cluster lets it start."""
    base = f"tcp://127.0.0.1:{free_port()}"
    common = ["--model", tiny_checkpoint("llama"), "--zmq-endpoint-base", base]
    roles = (["router", "--port", str(free_port())], ["prefill"], ["decode"], ["worker", "--role", "DecodeOnly"])
    for command in roles:
        done = subprocess.run([sys.executable, "-m", "deploy.cli", *command, *common], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2, (command, done.stderr[-2000:])
        assert "no cluster key" in done.stderr and "--cluster-key-file" in done.stderr, done.stderr[-2000:]
        assert "--insecure-cluster" in done.stderr
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "deploy.cli", "router", "--port", str(port), *common,
                               "--insecure-cluster"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and router.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert router.poll() is None and httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    finally:
        router.terminate()
        router.wait(20)
