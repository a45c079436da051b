"""pipeline.router_link: a worker registering without an answer says so in its own log."""

from __future__ import annotations

import logging
import tempfile
import time

import zmq

from pipeline import router_link
from pipeline.protocol.cluster import RegisterWorker, WorkerRole


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
