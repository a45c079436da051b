"""Router test fixtures: a real router (uvicorn in a thread, free port, private ipc base) and fake workers."""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time
from typing import Any, Iterator

import httpx
import pytest
import uvicorn

from pipeline.config import PipelineConfig
from router.app import create_app
from router.served_model import ServedModel, load_served_model
from tests.router.fake_worker import FakeWorker

MODEL_NAME = "tiny"
MAX_LENGTH = 64


@pytest.fixture(scope="session")
def served_model(tiny_checkpoint) -> ServedModel:
    """The tiny llama checkpoint's tokenizer, served as "tiny" with max_length 64 (loaded once)."""
    return load_served_model(tiny_checkpoint("llama"), max_length=MAX_LENGTH, name=MODEL_NAME)


class RouterServer:
    """A live router: ``url``, ``base`` (its zmq_endpoint_base), ``app``, plus worker helpers.

    ``options`` go to ``create_app``, except ``config``: a dict of further ``PipelineConfig`` fields.
    """

    def __init__(self, served_model: ServedModel, **options: Any) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="tdm", dir="/tmp")
        self.base = f"ipc://{self.tmpdir}/t"
        # Every P/D request through a prefill worker unless a test says otherwise (the tests' prompts are short).
        fields = {"router": {"max_local_prefill_length": 0}, **options.pop("config", {})}
        config = PipelineConfig(zmq_endpoint_base=self.base, max_length=MAX_LENGTH, **fields)
        options.setdefault("heartbeat_interval_s", 0.05)
        options.setdefault("dead_after_s", 1.0)
        options.setdefault("request_timeout_s", 10.0)
        self.app = create_app(config, served_model=served_model, **options)
        self.workers: list[FakeWorker] = []
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # a request a stopped fake worker still holds is cancelled at shutdown, not waited for (its timeout is 10 s)
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on",
                                                     timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._sock = sock

    def start(self) -> "RouterServer":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "router did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    @property
    def state(self):
        return self.app.state.router

    def add_worker(self, worker_id: str = "w0", wait: bool = True, **kwargs: Any) -> FakeWorker:
        kwargs.setdefault("model_name", MODEL_NAME)
        kwargs.setdefault("max_length", MAX_LENGTH)
        kwargs.setdefault("heartbeat_s", 0.05)
        worker = FakeWorker(self.base, worker_id, **kwargs).start()
        self.workers.append(worker)
        if wait:
            assert worker.wait_for(lambda: bool(worker.acks)), "worker got no RegisterAck"
        return worker

    def metric(self, name: str) -> float:
        """One sample from /metrics: ``name`` as exported, labels included (``'x_total{outcome="ok"}'``)."""
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not exported")

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Wait until nothing waits, nothing is in flight and no worker holds a router-side slot."""
        gauges = ("tandem_router_admission_queue_depth", "tandem_requests_in_flight", "tandem_router_queue_depth")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            values = {g: self.metric(g) for g in gauges}
            held = {w.worker_id: w.num_inflight for w in self.state.dispatcher.registry.all_workers() if w.num_inflight}
            if not any(values.values()) and not held:
                return
            time.sleep(0.02)
        raise AssertionError(f"router not idle: {values}, slots held: {held}")

    def wait_ready(self, expected: bool = True, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (httpx.get(f"{self.url}/ready").status_code == 200) == expected:
                return True
            time.sleep(0.02)
        return False


@pytest.fixture
def router_factory(served_model) -> Iterator:
    servers: list[RouterServer] = []

    def make(**options: Any) -> RouterServer:
        server = RouterServer(served_model, **options).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def router(router_factory) -> RouterServer:
    return router_factory()


@pytest.fixture
def client(router):
    """The official openai client of ``router`` (no retries: a test sees every answer as it came)."""
    import openai

    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=10)
