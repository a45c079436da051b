"""The router's one ZMQ socket: a ROUTER bound at ``router_endpoint(base)``, every worker a DEALER.

It only moves frames: ``send`` encodes and sends without ever blocking the event loop, the receive
loop decodes each frame with the worker->router decoder and hands ``(worker_id, message)`` to the
dispatcher. A frame that does not decode is counted, logged (rate-limited) and dropped.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from pipeline.protocol.cluster import WorkerToRouter, decode_worker_to_router, encode

logger = logging.getLogger(__name__)


class WorkerSocket:
    def __init__(
        self,
        endpoint: str,
        on_message: Callable[[str, WorkerToRouter], None],
        on_bad_frame: Callable[[], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.num_bad_frames = 0
        self._on_message = on_message
        self._on_bad_frame = on_bad_frame
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished worker fails now, not silently
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker reclaims its id
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
            self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._sock = self._ctx = None

    def send(self, worker_id: str, msg: msgspec.Struct) -> bool:
        """Send without blocking; False (logged) when the worker is unreachable or its queue is full."""
        if self._sock is None:
            return False
        # With NOBLOCK the future is already resolved: reading its exception also marks it retrieved.
        future = self._sock.send_multipart([worker_id.encode(), encode(msg)], flags=zmq.NOBLOCK)
        exc = future.exception() if future.done() else None
        if exc is not None:
            logger.warning("cannot send %s to worker %s: %s", type(msg).__name__, worker_id, exc)
            return False
        return True

    def count_bad_frame(self, identity: bytes | str, why: str) -> None:
        self.num_bad_frames += 1
        if self._on_bad_frame is not None:
            self._on_bad_frame()
        if self.num_bad_frames <= 10 or self.num_bad_frames % 1000 == 0:
            logger.warning("dropped a bad frame from %r (%d so far): %s", identity, self.num_bad_frames, why)

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            try:
                self._handle(frames)
            except Exception:  # one bad message must never stop the router
                logger.exception("error handling a worker message")

    def _handle(self, frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) != 2:
            self.count_bad_frame(identity[:64], f"expected 1 message frame, got {len(frames) - 1}")
            return
        try:
            worker_id = identity.decode()
            msg = decode_worker_to_router(frames[1])
        except UnicodeDecodeError:
            self.count_bad_frame(identity[:64], "routing id is not UTF-8")
            return
        except msgspec.DecodeError as exc:
            self.count_bad_frame(identity[:64], str(exc))
            return
        self._on_message(worker_id, msg)
