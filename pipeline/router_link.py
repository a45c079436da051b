"""A worker's connection to the router: registration, heartbeats, requests in, token batches out.

One DEALER socket (routing id = worker id) to the router's ROUTER at ``router_endpoint(base)``.
Registration is retried until the router acknowledges it, so workers may start before the router.
Frames that fail to decode are counted, logged and dropped. Used from the worker's single loop
thread only (ZMQ sockets are not thread-safe).
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from pipeline.endpoints import router_endpoint
from pipeline.protocol.cluster import (
    CancelRequest,
    GenerateRequest,
    Heartbeat,
    RegisterAck,
    RegisterWorker,
    TokenBatch,
    TokenDelta,
    WorkerLoad,
    decode_router_to_worker,
    encode,
)

logger = logging.getLogger(__name__)

REGISTER_RETRY_S = 0.5


class RegistrationRejected(RuntimeError):
    """The router refused this worker (e.g. a different model); the worker must not serve."""


class RouterLink:
    def __init__(self, ctx: zmq.Context, zmq_endpoint_base: str, registration: RegisterWorker) -> None:
        self.registration = registration
        self.worker_id = registration.worker_id
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, self.worker_id.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(router_endpoint(zmq_endpoint_base))
        self.is_registered = False
        self.heartbeat_interval_s = 0.5
        self.max_heartbeat_interval_s = 0.5
        self.num_bad_frames = 0
        self._last_register = 0.0
        self._last_heartbeat = 0.0

    def receive(self) -> list[GenerateRequest | CancelRequest]:
        """Every pending request from the router (non-blocking); handles acks internally."""
        messages: list[GenerateRequest | CancelRequest] = []
        while True:
            try:
                frame = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                message = decode_router_to_worker(frame)
            except msgspec.DecodeError as exc:
                self.num_bad_frames += 1
                logger.warning("dropped a malformed frame from the router (%d so far): %s", self.num_bad_frames, exc)
                continue
            if isinstance(message, RegisterAck):
                self._on_ack(message)
            else:
                messages.append(message)
        return messages

    def _on_ack(self, ack: RegisterAck) -> None:
        if ack.accepted:
            if not self.is_registered:
                logger.info("registered with the router as %s", self.worker_id)
            self.is_registered = True
            # The router says how often it needs a sign of life; a worker configured to report more often may.
            self.heartbeat_interval_s = min(ack.heartbeat_interval_s, self.max_heartbeat_interval_s)
        elif ack.reregister:
            self.is_registered = False
            self._last_register = 0.0
        else:
            raise RegistrationRejected(f"the router refused worker {self.worker_id}: {ack.error}")

    def tick(self, load: WorkerLoad) -> None:
        """Register (until acknowledged) or heartbeat when it is time."""
        now = time.monotonic()
        if not self.is_registered:
            if now - self._last_register >= REGISTER_RETRY_S:
                self.socket.send(encode(self.registration))
                self._last_register = now
        elif now - self._last_heartbeat >= self.heartbeat_interval_s:
            self.socket.send(encode(Heartbeat(worker_id=self.worker_id, load=load)))
            self._last_heartbeat = now

    def send_outputs(self, deltas: list[TokenDelta]) -> None:
        if deltas:
            self.socket.send(encode(TokenBatch(outputs=deltas)))

    def close(self) -> None:
        self.socket.close(linger=0)
