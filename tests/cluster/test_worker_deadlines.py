"""Every waiting state has a deadline: a worker in this process, the test playing the router."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from decode_worker.worker import DecodeWorker
from pipeline.config import PipelineConfig
from pipeline.endpoints import router_endpoint
from pipeline.protocol import SamplingParams
from pipeline.protocol.cluster import (
    FinishCode,
    GenerateRequest,
    PrefillAccepted,
    PrefillRejected,
    PrefillRequest,
    PrefillStarted,
    RegisterAck,
    RegisterWorker,
    TokenBatch,
    decode_prefill_to_decode,
    decode_worker_to_router,
    encode,
)
from prefill_worker.worker import PrefillWorker


class FakeRouter:
    """A ROUTER socket that acknowledges registrations and collects token deltas (``senders``: whose each was)."""

    def __init__(self, base: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(router_endpoint(base))
        self.deltas = []
        self.senders: list[str] = []

    def pump(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not self.sock.poll(20):
                continue
            identity, frame = self.sock.recv_multipart()
            message = decode_worker_to_router(frame)
            if isinstance(message, RegisterWorker):
                self.sock.send_multipart([identity, encode(RegisterAck(accepted=True, heartbeat_interval_s=0.2))])
            elif isinstance(message, TokenBatch):
                self.deltas.extend(message.outputs)
                self.senders.extend([identity.decode()] * len(message.outputs))

    def send(self, worker_id: str, message) -> None:
        self.sock.send_multipart([worker_id.encode(), encode(message)])

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def pd_pair_with_slow_decode(model_path: str, base: str, monkeypatch, delay_s: float = 0.5):
    """A prefill worker "p0" and a decode worker "d0" in this process (zmq transport); each decode step takes
    ``delay_s`` more, as on a slow model."""
    prefill = PrefillWorker(config(model_path, base, "PrefillOnly", transfer={"transport": "zmq"}), "p0")
    decode = DecodeWorker(config(model_path, base, "DecodeOnly", transfer={"transport": "zmq"}), "d0")
    step = decode.engine.step

    def slow_step():
        outputs = step()
        time.sleep(delay_s)
        return outputs

    monkeypatch.setattr(decode.engine, "step", slow_step)
    return prefill, decode


def run_in_thread(worker):
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    return stop, thread


def join_worker(thread: threading.Thread) -> None:
    """Wait for a stopped worker's thread: it must have closed everything (no thread left to the next test)."""
    thread.join(10)
    assert not thread.is_alive(), "a stopped worker's thread is still running"


@pytest.fixture
def base(tmp_path):
    return f"ipc://{tmp_path}/t"


def config(model_path: str, base: str, role: str, **extra) -> PipelineConfig:
    # drain_timeout_s 0: a stopped worker fails what is still in flight and closes at once, so its thread
    # (and its KV transfer threads) have ended when the test's teardown has joined it
    return PipelineConfig.load(overrides={
        "pipeline_role": role, "zmq_endpoint_base": base, "model": {"model_path": model_path},
        "kv_cache": {"page_size": 4, "num_blocks": 64}, "drain_timeout_s": 0, **extra,
    }, environ={})


def test_decode_reservation_expires_when_no_kv_arrives(tiny_checkpoint, base, tmp_path):
    router = FakeRouter(base)
    worker = DecodeWorker(config(tiny_checkpoint("llama"), base, "DecodeOnly",
                                 transfer={"transport": "zmq", "ttl_s": 0.5}), "d0")
    free_at_start = worker.engine.kv_manager.num_free_blocks
    stop, thread = run_in_thread(worker)
    try:
        router.pump(0.5)
        router.send("d0", GenerateRequest(request_id="r1", prompt_token_ids=list(range(3, 20)),
                                          sampling_params=SamplingParams(max_tokens=4),
                                          prefill_worker_id="ghost", prefill_endpoint=f"ipc://{tmp_path}/nobody"))
        started = time.monotonic()
        while not router.deltas and time.monotonic() - started < 10:
            router.pump(0.1)
        (delta,) = router.deltas
        assert delta.finish_reason == FinishCode.ERROR and delta.retryable and "timed out" in delta.error
        assert time.monotonic() - started < 5
        assert worker.engine.kv_manager.num_free_blocks == free_at_start
    finally:
        stop.set()
        join_worker(thread)
        router.close()


def test_prefill_hold_expires_when_decode_is_gone(tiny_checkpoint, base, tmp_path):
    router = FakeRouter(base)
    worker = PrefillWorker(config(tiny_checkpoint("llama"), base, "PrefillOnly"), "p0")
    free_at_start = worker.engine.kv_manager.num_free_blocks
    stop, thread = run_in_thread(worker)
    ctx = zmq.Context()
    decode = ctx.socket(zmq.DEALER)
    decode.setsockopt(zmq.LINGER, 0)
    decode.setsockopt(zmq.IDENTITY, b"d-gone")
    try:
        router.pump(0.3)
        decode.connect(worker.endpoint)
        request = PrefillRequest(request_id="r1", prompt_token_ids=list(range(3, 30)),
                                 sampling_params=SamplingParams(max_tokens=4), dst_block_ids=list(range(8)),
                                 num_cached_tokens=0, transfer_endpoint=f"ipc://{tmp_path}/dead-decoder",
                                 decode_worker_id="d-gone", ttl_s=1.0)
        decode.send(encode(request))
        decode.send(encode(request))  # a duplicate id is refused, not run twice
        answers = []
        while not any(isinstance(a, PrefillRejected) for a in answers):
            assert decode.poll(5000)
            answers.append(decode_prefill_to_decode(decode.recv()))
        assert isinstance(answers[0], PrefillAccepted)  # the first copy is queued, and says so at once
        rejected = answers[-1]
        assert "already" in rejected.error
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            router.pump(0.2)
            if not worker.jobs and worker.engine.kv_manager.num_free_blocks == free_at_start:
                break
        assert not worker.jobs, "the hold on blocks for a dead decode worker must expire"
        assert worker.engine.kv_manager.num_free_blocks == free_at_start
    finally:
        decode.close()
        ctx.term()
        stop.set()
        join_worker(thread)
        router.close()


def test_a_reservation_queued_on_a_busy_prefill_worker_waits_then_the_ttl_runs_from_the_start(
        tiny_checkpoint, base, tmp_path):
    router = FakeRouter(base)
    worker = DecodeWorker(config(tiny_checkpoint("llama"), base, "DecodeOnly",
                                 transfer={"transport": "zmq", "ttl_s": 0.5}), "d0")
    free_at_start = worker.engine.kv_manager.num_free_blocks
    stop, thread = run_in_thread(worker)
    ctx = zmq.Context()
    prefill = ctx.socket(zmq.ROUTER)  # plays a prefill worker with a long queue
    prefill.setsockopt(zmq.LINGER, 0)
    prefill.bind(f"ipc://{tmp_path}/busy-prefill")
    try:
        router.pump(0.5)
        router.send("d0", GenerateRequest(request_id="r1", prompt_token_ids=list(range(3, 20)),
                                          sampling_params=SamplingParams(max_tokens=4), prefill_worker_id="p0",
                                          prefill_endpoint=f"ipc://{tmp_path}/busy-prefill"))
        assert prefill.poll(5000)
        identity, _ = prefill.recv_multipart()
        prefill.send_multipart([identity, encode(PrefillAccepted(request_id="r1"))])
        router.pump(2.0)  # four TTLs queued behind other prompts: load, not a fault
        assert router.deltas == []
        prefill.send_multipart([identity, encode(PrefillStarted(request_id="r1"))])
        started = time.monotonic()
        while not router.deltas and time.monotonic() - started < 10:
            router.pump(0.1)
        (delta,) = router.deltas  # started, then silent: the TTL runs again
        assert delta.finish_reason == FinishCode.ERROR and "timed out" in delta.error
        assert time.monotonic() - started < 3
        deadline = time.monotonic() + 5
        while worker.engine.kv_manager.num_free_blocks != free_at_start and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.engine.kv_manager.num_free_blocks == free_at_start
    finally:
        prefill.close()
        ctx.term()
        stop.set()
        join_worker(thread)
        router.close()


def test_a_long_prompt_whose_chunks_keep_coming_outlives_the_ttl(tiny_checkpoint, base, monkeypatch):
    """The TTL is a bound on silence, not on a prompt's whole prefill: 16-token chunks of a 120-token prompt, each
    step 0.15 s longer (a slow model, or chunks beside other prompts'), take about 1.2 s, twice the 0.5 s TTL.
    An audit saw such prompts retried (6 of 8 at once, 1,500 tokens each, TTL 2 s) while every chunk came."""
    router = FakeRouter(base)
    transfer = {"transport": "zmq", "ttl_s": 0.5}
    prefill = PrefillWorker(config(tiny_checkpoint("llama"), base, "PrefillOnly", transfer=transfer,
                                   max_batch_input_tokens=16, long_prefill_token_threshold=None), "p0")
    decode = DecodeWorker(config(tiny_checkpoint("llama"), base, "DecodeOnly", transfer=transfer), "d0")
    step = prefill.engine.step

    def slow_step():
        outputs = step()
        time.sleep(0.15)
        return outputs

    monkeypatch.setattr(prefill.engine, "step", slow_step)
    free_at_start = decode.engine.kv_manager.num_free_blocks
    threads = [run_in_thread(prefill), run_in_thread(decode)]
    try:
        router.pump(0.5)
        started = time.monotonic()
        router.send("d0", GenerateRequest(request_id="long", prompt_token_ids=[3 + i % 50 for i in range(120)],
                                          sampling_params=SamplingParams(max_tokens=3, temperature=0.0,
                                                                         ignore_eos=True),
                                          prefill_worker_id="p0", prefill_endpoint=prefill.endpoint))
        ours = []
        while not any(d.finish_reason is not None for d in ours):
            assert time.monotonic() - started < 20, "the request never finished"
            router.pump(0.1)
            ours = [d for d, who in zip(router.deltas, router.senders) if who == "d0"]
        assert [d.error for d in ours if d.error] == []  # not "prefill timed out"
        assert sum(len(d.token_ids) for d in ours) >= 2 and time.monotonic() - started > 1.0
        deadline = time.monotonic() + 5
        while decode.engine.kv_manager.num_free_blocks != free_at_start and time.monotonic() < deadline:
            router.pump(0.05)
        assert decode.engine.kv_manager.num_free_blocks == free_at_start
    finally:
        for stop, thread in threads:
            stop.set()
            join_worker(thread)
        router.close()


def test_a_first_token_whose_kv_arrived_goes_out_before_the_next_step(tiny_checkpoint, base, monkeypatch):
    """The decode worker reads a finished transfer between steps; the first token it carries is the
    request's TTFT, so it goes to the router at once, not with the tokens of the step that follows
    (a slow model here: every step of the decode worker takes half a second more)."""
    router = FakeRouter(base)
    batches = []
    prefill, decode = pd_pair_with_slow_decode(tiny_checkpoint("llama"), base, monkeypatch)
    send = decode.link.send_outputs
    monkeypatch.setattr(decode.link, "send_outputs", lambda deltas: (batches.append(list(deltas)) if deltas else None,
                                                                    send(deltas)))
    threads = [run_in_thread(prefill), run_in_thread(decode)]
    try:
        router.pump(0.5)
        greedy = dict(temperature=0.0, ignore_eos=True)
        router.send("d0", GenerateRequest(request_id="busy", prompt_token_ids=list(range(3, 12)),
                                          sampling_params=SamplingParams(max_tokens=40, **greedy)))
        while not any(d.request_id == "busy" for d in router.deltas):
            router.pump(0.1)
        router.send("d0", GenerateRequest(request_id="new", prompt_token_ids=list(range(3, 40)),
                                          sampling_params=SamplingParams(max_tokens=3, **greedy),
                                          prefill_worker_id="p0", prefill_endpoint=prefill.endpoint))
        deadline = time.monotonic() + 20
        # (the prefill worker streams the first token too, beside the KV: the decode worker's is the one tested)
        while not any(d.request_id == "new" and d.token_ids and who == "d0" for d, who in zip(router.deltas, router.senders)):
            assert time.monotonic() < deadline, "no first token"
            router.pump(0.1)
        [with_first] = [b for b in batches if any(d.request_id == "new" and d.token_ids for d in b)][:1]
        assert [d.request_id for d in with_first] == ["new"], "the first token waited for the next step's tokens"
    finally:
        for stop, thread in threads:
            stop.set()
            join_worker(thread)
        router.close()
