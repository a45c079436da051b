"""Decode-side connections to prefill workers: one DEALER per prefill endpoint, opened on first use."""

from __future__ import annotations

import logging

import msgspec
import zmq

from pipeline.protocol.cluster import (
    CancelPrefill,
    PrefillAccepted,
    PrefillRejected,
    PrefillRequest,
    PrefillStarted,
    decode_prefill_to_decode,
    encode,
)

logger = logging.getLogger(__name__)


class PrefillLinks:
    def __init__(self, ctx: zmq.Context, worker_id: str) -> None:
        self.ctx = ctx
        self.worker_id = worker_id
        self._sockets: dict[str, zmq.Socket] = {}
        self.num_bad_frames = 0

    def send(self, endpoint: str, message: PrefillRequest | CancelPrefill) -> None:
        sock = self._sockets.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, self.worker_id.encode())
            sock.setsockopt(zmq.LINGER, 0)
            # A dead prefill worker must not make sends block: queue a bounded amount, then drop
            # (the TTL on the reservation ends such requests).
            sock.setsockopt(zmq.SNDHWM, 10_000)
            sock.connect(endpoint)
            self._sockets[endpoint] = sock
        try:
            sock.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("prefill worker at %s is not draining its queue; dropped %s", endpoint,
                           type(message).__name__)

    def receive(self) -> list[PrefillRejected | PrefillAccepted | PrefillStarted]:
        messages = []
        for endpoint, sock in self._sockets.items():
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    messages.append(decode_prefill_to_decode(frame))
                except msgspec.DecodeError as exc:
                    self.num_bad_frames += 1
                    logger.warning("dropped a malformed frame from %s: %s", endpoint, exc)
        return messages

    def sockets(self) -> list[zmq.Socket]:
        return list(self._sockets.values())

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
