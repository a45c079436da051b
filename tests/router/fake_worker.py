"""A scripted stand-in for a worker: a real ZMQ DEALER that registers, heartbeats and answers requests.

It runs in its own thread with a plain (sync) zmq socket. ``script(request)`` returns the outputs for
a ``GenerateRequest`` as ``[(delay_s, TokenDelta), ...]`` (delays from the request's arrival); deltas
due at the same poll are sent together as one TokenBatch, as a real decode step would. ``held``
scripts nothing: the test answers by hand with ``emit``. ``max_batch_size`` is reported at registration
(0: unknown, so the router never sees the worker as saturated).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

import zmq

from pipeline.config import PipelineRole
from pipeline.endpoints import router_endpoint
from pipeline.protocol.cluster import (
    CancelRequest,
    FinishCode,
    GenerateRequest,
    HandoffDeclined,
    Heartbeat,
    RegisterAck,
    RegisterWorker,
    StartPrefill,
    TokenBatch,
    TokenDelta,
    WarmPrefix,
    WorkerLoad,
    WorkerRole,
    decode_router_to_worker,
    encode,
)

Script = Callable[[GenerateRequest], list[tuple[float, TokenDelta]]]


def held(_request: GenerateRequest) -> list[tuple[float, TokenDelta]]:
    """A script that answers nothing: the test finishes requests with ``FakeWorker.emit``."""
    return []


def tokens_script(token_ids: list[int], step_s: float = 0.005, finish: FinishCode = FinishCode.LENGTH,
                  stop_token_id: int | None = None, logprobs: bool = False) -> Script:
    """Emit ``token_ids`` one per step (capped at max_tokens), the last delta carrying ``finish``."""
    from pipeline.protocol.requests import TokenLogprob

    def script(req: GenerateRequest) -> list[tuple[float, TokenDelta]]:
        ids = token_ids[: req.sampling_params.max_tokens or len(token_ids)]
        out = []
        for i, token_id in enumerate(ids):
            is_last = i == len(ids) - 1
            lps = None
            if logprobs and req.sampling_params.logprobs is not None:
                n = req.sampling_params.logprobs
                lps = [[TokenLogprob(token_id, -0.5 - i)] + [TokenLogprob(token_id + k + 1, -1.0 - k) for k in range(n)]]
            out.append((step_s * (i + 1), TokenDelta(
                request_id=req.request_id, token_ids=[token_id], logprobs=lps,
                finish_reason=finish if is_last else None,
                stop_token_id=stop_token_id if is_last else None,
                num_prompt_tokens=len(req.prompt_token_ids) if i == 0 else 0,
                num_cached_tokens=3 if i == 0 else 0,
            )))
        return out

    return script


class FakeWorker:
    def __init__(
        self,
        zmq_endpoint_base: str,
        worker_id: str,
        script: Script | None = None,
        role: PipelineRole = PipelineRole.PrefillAndDecode,
        model_name: str = "tiny",
        max_length: int = 256,
        num_total_blocks: int = 64,
        prefill_endpoint: str | None = None,
        heartbeat_s: float = 0.05,
        load: WorkerLoad | None = None,
        max_batch_size: int = 0,
        page_size: int = 16,
        pid: int | None = None,
    ) -> None:
        self.endpoint = router_endpoint(zmq_endpoint_base)
        self.worker_id = worker_id
        self.script = script or tokens_script([10, 11, 12])
        self.register_msg = RegisterWorker(
            worker_id=worker_id, role=WorkerRole.from_pipeline_role(role), model_name=model_name,
            max_length=max_length, page_size=page_size, num_total_blocks=num_total_blocks,
            prefill_endpoint=prefill_endpoint, pid=pid or os.getpid(), max_batch_size=max_batch_size,
        )
        self.heartbeat_s = heartbeat_s
        self.load = load or WorkerLoad(num_free_blocks=num_total_blocks, num_total_blocks=num_total_blocks)
        self.is_heartbeating = True
        self.requests: list[GenerateRequest] = []
        self.cancels: list[str] = []
        self.declined: list[str] = []  # handoff offers the router declined
        self.warmups: list[list[int]] = []  # WarmPrefix token ids (a prefill worker's)
        self.early_starts: list[StartPrefill] = []  # prompts the router started here early (a prefill worker's)
        self.acks: list[RegisterAck] = []
        self._raw_out: list[list[bytes]] = []
        self._scheduled: list[tuple[float, TokenDelta]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._frozen = threading.Event()  # SIGSTOP's stand-in: nothing in or out, same process (pid) after
        self._thread = threading.Thread(target=self._run, name=f"fake-{worker_id}", daemon=True)

    def start(self) -> "FakeWorker":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def freeze(self) -> None:
        """Neither read nor send (heartbeats, tokens) until ``thaw``: a stopped process, not a dead one."""
        self._frozen.set()

    def thaw(self) -> None:
        self._frozen.clear()

    def send_raw(self, *frames: bytes) -> None:
        with self._lock:
            self._raw_out.append(list(frames))

    def emit(self, *deltas: TokenDelta) -> None:
        """Send ``deltas`` to the router now, as one TokenBatch."""
        self.send_raw(encode(TokenBatch(outputs=list(deltas))))

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.005)
        return predicate()

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.worker_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        try:
            sock.send(encode(self.register_msg))
            next_heartbeat = time.monotonic()
            while not self._stop.is_set():
                if self._frozen.is_set():
                    time.sleep(0.005)
                    continue
                if sock.poll(5):
                    while sock.poll(0):
                        self._on_message(sock.recv())
                now = time.monotonic()
                if self.is_heartbeating and now >= next_heartbeat:
                    sock.send(encode(Heartbeat(worker_id=self.worker_id, load=self.load)))
                    next_heartbeat = now + self.heartbeat_s
                with self._lock:
                    due = [d for t, d in self._scheduled if t <= now]
                    self._scheduled = [(t, d) for t, d in self._scheduled if t > now]
                    raw, self._raw_out = self._raw_out, []
                if due:
                    sock.send(encode(TokenBatch(outputs=due)))
                for frames in raw:
                    sock.send_multipart(frames)
        finally:
            sock.close(0)
            ctx.term()

    def _on_message(self, frame: bytes) -> None:
        msg = decode_router_to_worker(frame)
        if isinstance(msg, GenerateRequest):
            self.requests.append(msg)
            arrival = time.monotonic()
            with self._lock:
                self._scheduled.extend((arrival + delay, delta) for delay, delta in self.script(msg))
        elif isinstance(msg, CancelRequest):
            self.cancels.append(msg.request_id)
            with self._lock:
                self._scheduled = [(t, d) for t, d in self._scheduled if d.request_id != msg.request_id]
        elif isinstance(msg, HandoffDeclined):
            self.declined.append(msg.request_id)
        elif isinstance(msg, WarmPrefix):
            self.warmups.append(msg.token_ids)
        elif isinstance(msg, StartPrefill):
            self.early_starts.append(msg)
        elif isinstance(msg, RegisterAck):
            self.acks.append(msg)
            if not msg.accepted and msg.reregister:
                self.send_raw(encode(self.register_msg))
