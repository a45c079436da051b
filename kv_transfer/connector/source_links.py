"""The sink's connections to sources (prefill workers, draining decode workers): one DEALER per source
endpoint, opened on first use."""

from __future__ import annotations

import logging

import zmq

from pipeline.protocol.cluster import (
    CancelPrefill,
    PrefillAccepted,
    PrefillRejected,
    PrefillRequest,
    PrefillStarted,
    PrefillToDecode,
    decode_prefill_to_decode,
)
from pipeline.protocol.typed_socket import TypedSocket

logger = logging.getLogger(__name__)


class SourceLinks:
    def __init__(self, ctx: zmq.Context, worker_id: str) -> None:
        self.ctx = ctx
        self.worker_id = worker_id
        self._sockets: dict[str, TypedSocket[PrefillToDecode]] = {}

    @property
    def num_bad_frames(self) -> int:
        return sum(sock.num_bad_frames for sock in self._sockets.values())

    def send(self, endpoint: str, message: PrefillRequest | CancelPrefill) -> None:
        sock = self._sockets.get(endpoint)
        if sock is None:
            # A dead prefill worker must not make sends block: queue a bounded amount, then drop
            # (the TTL on the reservation ends such requests).
            sock = TypedSocket(self.ctx, zmq.DEALER, decode_prefill_to_decode, "prefill link", logger=logger,
                               identity=self.worker_id, sndhwm=10_000)
            sock.connect(endpoint)
            self._sockets[endpoint] = sock
        try:
            sock.send(message, flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("prefill worker at %s is not draining its queue; dropped %s", endpoint,
                           type(message).__name__)

    def receive(self) -> list[PrefillRejected | PrefillAccepted | PrefillStarted]:
        return [got.message for sock in self._sockets.values() for got in sock.receive_ready()]

    def sockets(self) -> list[zmq.Socket]:
        return [sock.socket for sock in self._sockets.values()]

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()
