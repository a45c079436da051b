"""The router in a process of its own under SIGTERM (``run_router``): it stops accepting, lets what is in flight
finish within ``drain_timeout_s``, answers what outlives it with an error, and exits 0."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import httpx

from tests.router.fake_worker import FakeWorker, tokens_script
from tests.router.test_admission import TEXT, body, in_thread, post, wait_until


@contextlib.contextmanager
def router_process(checkpoint: str, drain_timeout_s: float, script):
    """``run_router`` in its own process with one fake worker answering by ``script``: yields a namespace (process,
    url, port, name, worker, output), ``output`` filled with what the process printed once it ended."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    tmpdir = tempfile.mkdtemp(prefix="tdm", dir="/tmp")  # ipc paths must stay short
    base = f"ipc://{tmpdir}/t"
    code = f"""
from pipeline.config import PipelineConfig
from router.app import run_router
config = PipelineConfig(zmq_endpoint_base={base!r}, model={{"model_path": {checkpoint!r}}},
                        drain_timeout_s={drain_timeout_s})
run_router(config, "127.0.0.1", {port})
"""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    process = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run = SimpleNamespace(process=process, url=f"http://127.0.0.1:{port}", port=port, worker=None, output="")
    try:
        wait_until(lambda: process.poll() is None and _is_up(run.url), timeout=30)
        run.name = httpx.get(f"{run.url}/v1/models").json()["data"][0]["id"]
        run.worker = FakeWorker(base, "w0", script=script, model_name=run.name).start()
        wait_until(lambda: bool(run.worker.acks))
        yield run
    finally:
        if run.worker is not None:
            run.worker.stop()
        if process.poll() is None:
            process.kill()
        run.output = process.communicate(timeout=10)[0].decode(errors="replace")
        shutil.rmtree(tmpdir, ignore_errors=True)
        print(run.output[-3000:])  # shown when the test fails


def test_sigterm_drains_streams_in_flight_and_refuses_new_connections(tiny_checkpoint, served_model):
    """``run_router`` in its own process: SIGTERM stops accepting, the running stream finishes, then it exits."""
    ids = served_model.tokenizer.encode(TEXT)
    with router_process(tiny_checkpoint("llama"), 10, tokens_script(ids, step_s=1.5 / len(ids))) as run:
        streaming = in_thread(post, SimpleNamespace(url=run.url), {**body(stream=True), "model": run.name})
        wait_until(lambda: len(run.worker.requests) == 1)
        time.sleep(0.2)
        run.process.send_signal(signal.SIGTERM)
        wait_until(lambda: not _accepts_connections(run.port), timeout=2)  # refuses new work while draining
        answer = streaming.join()
        assert answer.status == 200 and answer.is_complete and answer.text == TEXT, answer
        assert run.process.wait(timeout=10) == 0
    assert "Waiting for connections to close" in run.output, run.output[-2000:]


def test_what_outlives_the_drain_is_answered_with_an_error_not_cut(tiny_checkpoint, served_model):
    """At drain_timeout_s the requests still running end with the OpenAI error body (503) or, streamed, an error
    event: an audit saw uvicorn's own deadline cut them (a plain-text 500, a stream ending mid-way, no word)."""
    ids = served_model.tokenizer.encode(TEXT)
    with router_process(tiny_checkpoint("llama"), 1, tokens_script(ids, step_s=30 / len(ids))) as run:
        streaming = in_thread(post, SimpleNamespace(url=run.url), {**body(stream=True), "model": run.name})
        whole = in_thread(post, SimpleNamespace(url=run.url), {**body(), "model": run.name})
        wait_until(lambda: len(run.worker.requests) == 2)
        time.sleep(0.5)
        run.process.send_signal(signal.SIGTERM)
        for answer in (streaming.join(), whole.join()):
            assert not answer.is_complete and answer.error is not None, answer
            assert "did not finish within drain_timeout_s (1 s)" in answer.error["message"], answer
        assert whole.join().status == 503
        assert run.process.wait(timeout=15) == 0
    assert "Cancel" not in run.output and "Traceback" not in run.output, run.output[-2000:]


def _is_up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _accepts_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False
