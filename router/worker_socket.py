"""The router's one ZMQ socket: a ROUTER bound at ``router_endpoint(base)``, every worker a DEALER.

It only moves frames, through the typed socket wrapper (``pipeline/protocol/typed_socket.py``): ``send``
encodes and sends without ever blocking the event loop, the receive loop takes each message the
worker->router decoder accepts and hands ``(worker_id, message)`` to the dispatcher. A frame that does
not decode (or whose routing id is not UTF-8) is counted, logged (rate-limited) and dropped.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from pipeline.protocol.cluster import WorkerToRouter, decode_worker_to_router
from pipeline.protocol.typed_socket import TypedSocket

logger = logging.getLogger(__name__)


class WorkerSocket:
    def __init__(
        self,
        endpoint: str,
        on_message: Callable[[str, WorkerToRouter], None],
        on_bad_frame: Callable[[], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._on_message = on_message
        self._on_bad_frame = on_bad_frame
        self._num_bad_frames_before = 0  # of sockets stopped earlier
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: TypedSocket[WorkerToRouter] | None = None
        self._task: asyncio.Task | None = None

    @property
    def num_bad_frames(self) -> int:
        return self._num_bad_frames_before + (self._sock.num_bad_frames if self._sock is not None else 0)

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        # A send to a vanished worker fails now, not silently; a restarted worker reclaims its id.
        sock = TypedSocket(self._ctx, zmq.ROUTER, decode_worker_to_router, "router socket",
                           on_bad_frame=self._on_bad_frame, logger=logger,
                           router_mandatory=True, router_handover=True)
        sock.bind(self.endpoint)
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._recv_loop())
        logger.info("router listening for workers at %s", self.endpoint)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._sock is not None:
            self._num_bad_frames_before += self._sock.num_bad_frames
            self._sock.close()
        if self._ctx is not None:
            self._ctx.term()
        self._sock = self._ctx = None

    def send(self, worker_id: str, msg: msgspec.Struct) -> bool:
        """Send without blocking; False (logged) when the worker is unreachable or its queue is full."""
        if self._sock is None:
            return False
        try:
            self._sock.send(msg, to=worker_id.encode(), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("cannot send %s to worker %s: %s", type(msg).__name__, worker_id, exc)
            return False
        return True

    def count_bad_frame(self, identity: bytes | str, why: str) -> None:
        """A message that decoded but fails the dispatcher's checks: counted and logged like a bad frame."""
        if self._sock is not None:
            self._sock.count_bad_frame(identity, why)

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        while True:
            try:
                message, identity, _ = await self._sock.receive_async()
            except asyncio.CancelledError:
                raise
            except Exception:  # whatever one frame does, the router keeps hearing its workers
                logger.exception("error receiving a worker frame; dropped")
                continue
            try:
                worker_id = identity.decode()
            except UnicodeDecodeError:
                self._sock.count_bad_frame(identity, "routing id is not UTF-8")
                continue
            try:
                self._on_message(worker_id, message)
            except Exception:  # one bad message must never stop the router
                logger.exception("error handling a worker message")
