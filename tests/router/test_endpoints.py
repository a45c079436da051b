"""pipeline.endpoints: every address derives from zmq_endpoint_base, and bad bases fail clearly."""

from __future__ import annotations

import tempfile

import pytest
import zmq

from pipeline.endpoints import EndpointError, router_endpoint, validate_endpoint_base, worker_bind_endpoint


def test_ipc_addresses_are_unique_paths_under_the_base():
    base = "ipc:///tmp/tandem"
    assert router_endpoint(base) == "ipc:///tmp/tandem-router"
    assert worker_bind_endpoint(base, "p0", "prefill") == "ipc:///tmp/tandem-p0-prefill"
    names = {worker_bind_endpoint(base, w, n) for w in ("p0", "p1", "d0") for n in ("prefill", "kv")}
    assert len(names) == 6 and router_endpoint(base) not in names


def test_ipc_worker_ids_are_sanitized_and_long_ones_hashed():
    assert worker_bind_endpoint("ipc:///tmp/t", "host/1:a b", "kv") == "ipc:///tmp/t-host_1_a_b-kv"
    long_id = "decode-" + "x" * 200
    endpoint = worker_bind_endpoint("ipc:///tmp/t", long_id, "kv")
    assert len(endpoint) - len("ipc://") <= 100
    assert endpoint == worker_bind_endpoint("ipc:///tmp/t", long_id, "kv")  # stable
    assert endpoint != worker_bind_endpoint("ipc:///tmp/t", long_id + "y", "kv")


def test_tcp_router_is_the_base_and_workers_bind_ephemeral_ports():
    base = "tcp://10.0.0.5:25000"
    assert router_endpoint(base) == base
    assert worker_bind_endpoint(base, "p0", "prefill") == "tcp://10.0.0.5:*"
    assert worker_bind_endpoint(base, "p0", "kv", host="10.0.0.6") == "tcp://10.0.0.6:*"
    assert worker_bind_endpoint("tcp://[::1]:25000", "p0", "kv") == "tcp://[::1]:*"
    assert worker_bind_endpoint(base, "p0", "kv", host="::1") == "tcp://[::1]:*"


@pytest.mark.parametrize(
    "base, words",
    [
        ("http://localhost:8000", "ipc:// (one host) or tcp://"),
        ("inproc://x", "ipc:// (one host) or tcp://"),
        ("/tmp/tandem", "ipc:// (one host) or tcp://"),
        ("", "non-empty"),
        ("ipc://", "file path prefix"),
        ("ipc:///tmp/dir/", "file path prefix"),
        ("ipc:///tmp/" + "a" * 120, "too long"),
        ("tcp://localhost", "tcp://HOST:PORT"),
        ("tcp://:25000", "tcp://HOST:PORT"),
        ("tcp://*:25000", "not '*'"),
        ("tcp://host:0", "1..65535"),
        ("tcp://host:http", "1..65535"),
    ],
)
def test_bad_bases_are_rejected_with_a_reason(base, words):
    with pytest.raises(EndpointError, match="zmq_endpoint_base") as info:
        validate_endpoint_base(base)
    assert words in str(info.value)
    assert isinstance(info.value, ValueError)


def test_bad_names_are_rejected():
    with pytest.raises(EndpointError, match="endpoint name"):
        worker_bind_endpoint("ipc:///tmp/t", "w", "a/b")
    with pytest.raises(EndpointError, match="worker_id"):
        worker_bind_endpoint("ipc:///tmp/t", "", "kv")


def test_derived_addresses_bind_and_connect():
    """ipc paths bind as given; a tcp '*' port binds and LAST_ENDPOINT is the address peers connect to."""
    ctx = zmq.Context()
    try:
        with tempfile.TemporaryDirectory(prefix="tdm", dir="/tmp") as tmp:
            base = f"ipc://{tmp}/t"
            server = ctx.socket(zmq.ROUTER)
            server.bind(worker_bind_endpoint(base, "p0", "prefill"))
            server.close(0)
        server = ctx.socket(zmq.ROUTER)
        server.bind(worker_bind_endpoint("tcp://127.0.0.1:25000", "p0", "prefill"))
        reported = server.getsockopt(zmq.LAST_ENDPOINT).decode()
        assert reported.startswith("tcp://127.0.0.1:") and not reported.endswith(":*")
        client = ctx.socket(zmq.DEALER)
        client.connect(reported)
        client.send(b"ping")
        assert server.poll(2000)
        assert server.recv_multipart()[1] == b"ping"
        client.close(0)
        server.close(0)
    finally:
        ctx.term()


def test_workers_bind_on_their_address_on_the_route_to_the_router():
    from pipeline.config import PipelineConfig
    from pipeline.endpoints import default_bind_host

    assert default_bind_host("tcp://127.0.0.1:25000") == "127.0.0.1"
    assert default_bind_host("ipc:///tmp/tandem") is None
    config = PipelineConfig(zmq_endpoint_base="tcp://127.0.0.1:25000")
    assert config.resolved_bind_host() == "127.0.0.1"
    assert PipelineConfig(zmq_endpoint_base="tcp://127.0.0.1:25000", bind_host="10.1.2.3").resolved_bind_host() == "10.1.2.3"
    assert worker_bind_endpoint("tcp://127.0.0.1:25000", "w", "kv", host=config.resolved_bind_host()) == "tcp://127.0.0.1:*"
