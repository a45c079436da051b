"""pipeline.router_link: a worker registering without an answer says so in its own log."""

from __future__ import annotations

import logging
import tempfile
import time

import pytest
import zmq

from pipeline import router_link, security
from pipeline.protocol.cluster import RegisterWorker, WorkerRole, decode_worker_to_router
from pipeline.protocol.typed_socket import TypedSocket


def test_registering_without_an_answer_is_logged_with_what_to_check(monkeypatch, caplog):
    """A worker with another cluster key is refused before any message: only the router logged it, and the worker
    said "serving" and waited silently."""
    monkeypatch.setattr(router_link, "UNANSWERED_WARN_S", 0.3)
    base = f"ipc://{tempfile.mkdtemp(dir='/tmp')}/nobody"  # no router listens here
    registration = RegisterWorker(worker_id="w0", role=WorkerRole.DECODE_ONLY, model_name="m", max_length=64,
                                  page_size=4, num_total_blocks=8)
    ctx = zmq.Context()
    with caplog.at_level(logging.WARNING, logger="pipeline.router_link"):
        link = router_link.RouterLink(ctx, base, registration)
        try:
            deadline = time.monotonic() + 10
            while not any("no answer from the router" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "no warning"
                time.sleep(0.05)
        finally:
            link.close()
            ctx.destroy(linger=0)
    message = next(r.getMessage() for r in caplog.records if "no answer" in r.getMessage())
    assert "worker w0: no answer from the router at ipc://" in message and "Is it running?" in message


@pytest.mark.parametrize("router_keyed", [True, False])
def test_a_worker_whose_security_differs_from_the_router_s_says_so(router_keyed, monkeypatch, caplog, tmp_path):
    """A keyed router and a worker with --insecure-cluster (or the reverse): the handshake fails on the mechanism,
    libzmq keeps no connection to queue on, and the link's blocking send used to stop its thread for good: the
    worker said "serving", then nothing, ever."""
    monkeypatch.setattr(router_link, "UNANSWERED_WARN_S", 0.3)
    key = security.load_cluster_key(security.generate_cluster_key(tmp_path))
    ctx = zmq.Context()
    security.set_cluster_key(key if router_keyed else None)
    router = TypedSocket(ctx, zmq.ROUTER, decode_worker_to_router, "router")
    endpoint = router.bind("tcp://127.0.0.1:*")
    security.set_cluster_key(None if router_keyed else key)
    registration = RegisterWorker(worker_id="w1", role=WorkerRole.DECODE_ONLY, model_name="m", max_length=64,
                                  page_size=4, num_total_blocks=8)
    try:
        with caplog.at_level(logging.WARNING, logger="pipeline.router_link"):
            link = router_link.RouterLink(ctx, endpoint, registration)  # on tcp://, the base is the router's address
            try:
                deadline = time.monotonic() + 10
                while sum("no answer from the router" in r.getMessage() for r in caplog.records) < 2:
                    assert time.monotonic() < deadline, "the link stopped warning"
                    time.sleep(0.05)
            finally:
                link.close()
    finally:
        security.set_cluster_key(None)
        router.close()
        ctx.destroy(linger=0)
    message = next(r.getMessage() for r in caplog.records if "no answer" in r.getMessage())
    assert "or both run --insecure-cluster" in message
