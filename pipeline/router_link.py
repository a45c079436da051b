"""A worker's connection to the router: registration, heartbeats, requests in, token batches out.

One DEALER socket (routing id = worker id) to the router's ROUTER at ``router_endpoint(base)``, owned
by a background thread of its own, so that **no engine step can delay a heartbeat**: a busy worker
keeps saying so ("inside a step for N s"), and only a gone or frozen process falls silent. The same
thread reads every frame from the router at once (cancels included), answers registration acks and
runs the stall watchdog: a step longer than ``step_stall_timeout_s`` means a wedged engine, and the
process exits so that its launcher restarts it.

The worker's loop thread talks to that thread through an inproc PAIR socket (``socket``: what the
loop's poller waits on; it becomes readable when requests arrive) and plain attributes written by
the loop and read by the heartbeat (``load``, ``step_started_at``). ZMQ sockets are never shared
between threads. Registration is retried until the router acknowledges it, so workers may start
before the router. Sockets open through ``pipeline/protocol/typed_socket.py``, whose wrapper decodes the
router's frames: one that fails to decode is counted, logged and dropped there.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time

import msgspec
import zmq

from pipeline.endpoints import router_endpoint
from pipeline.protocol.cluster import (
    CancelRequest,
    GenerateRequest,
    HandoffDeclined,
    Heartbeat,
    KVEvents,
    RegisterAck,
    RegisterWorker,
    RouterToWorker,
    TokenBatch,
    TokenDelta,
    WorkerLoad,
    decode_router_to_worker,
    encode,
)
from pipeline.protocol.typed_socket import TypedSocket, open_socket
from pipeline.sign_of_life import SignOfLife

logger = logging.getLogger(__name__)

REGISTER_RETRY_S = 0.5
UNANSWERED_WARN_S = 10.0  # registering this long without an answer: say so (and again at each such interval)
STALL_EXIT_CODE = 75  # EX_TEMPFAIL: the launcher restarts a worker that exits with it


class RegistrationRejected(ValueError):
    """The router refused this worker (e.g. a different model); the worker must not serve. A ValueError: the CLI
    says it as one line (``tandem decode: error: the router refused worker ...``), as any configuration error."""


class RouterLink:
    def __init__(self, ctx: zmq.Context, zmq_endpoint_base: str, registration: RegisterWorker, *,
                 heartbeat_interval_s: float = 0.5, step_stall_timeout_s: float | None = None) -> None:
        self.registration = registration
        self.worker_id = registration.worker_id
        self.max_heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.step_stall_timeout_s = step_stall_timeout_s
        self.is_registered = False
        self.kv_snapshot_wanted = False  # set on each registration (IO thread), cleared by the loop thread
        self._kv_seq = 0
        # Written by the loop thread, read by the heartbeat (single assignments: atomic under the GIL).
        self.load = WorkerLoad()
        self._load_at = float("-inf")  # when ``load`` was last refreshed
        self.step_started_at: float | None = None
        self._num_steps = 0
        self._max_step_s = 0.0
        self._inbox: collections.deque[GenerateRequest | CancelRequest] = collections.deque()
        self._rejection: str | None = None
        self._stopping = False
        self._sign_of_life = SignOfLife()  # this thread's loop alive: the launcher's watchdog (deploy.watchdog)
        address = f"inproc://router-link-{id(self)}"
        # The inproc pair carries wake-ups and messages encoded already (forwarded as they are): no decoder.
        self._io_end = open_socket(ctx, zmq.PAIR)
        self._io_end.bind(address)
        self.socket = open_socket(ctx, zmq.PAIR)  # the loop thread's end
        self.socket.connect(address)
        self._dealer: TypedSocket[RouterToWorker] = TypedSocket(
            ctx, zmq.DEALER, decode_router_to_worker, f"router link {self.worker_id}", logger=logger,
            identity=self.worker_id)
        self._router_endpoint = router_endpoint(zmq_endpoint_base)
        self._dealer.connect(self._router_endpoint)
        self._thread = threading.Thread(target=self._main, name=f"router-link-{self.worker_id}", daemon=True)
        self._thread.start()

    @property
    def num_bad_frames(self) -> int:
        """Frames from the router dropped undecoded (read by the loop thread for the load report)."""
        return self._dealer.num_bad_frames

    # ------------------------------------------------------------ loop thread
    def receive(self) -> list[GenerateRequest | CancelRequest | HandoffDeclined]:
        """Every request the router sent since the last call (non-blocking)."""
        while True:
            try:
                self.socket.recv(zmq.NOBLOCK)  # wake-ups only; the messages wait in the inbox
            except zmq.Again:
                break
        if self._rejection is not None:
            raise RegistrationRejected(f"the router refused worker {self.worker_id}: {self._rejection}")
        messages = []
        while self._inbox:
            messages.append(self._inbox.popleft())
        return messages

    def send_outputs(self, deltas: list[TokenDelta]) -> None:
        if deltas:
            self.socket.send(encode(TokenBatch(outputs=deltas)))

    def send(self, message) -> None:
        """Any other worker -> router message (a ``HandoffOffer``), in order with the token batches."""
        self.socket.send(encode(message))

    def send_kv_events(self, prefix_cache) -> None:
        """The prefix cache's changes for the router's index (loop thread, in order with token batches):
        a snapshot after each registration, then numbered batches of what changed. ``prefix_cache`` has
        ``prefix_cache_snapshot()`` and ``drain_prefix_cache_events()`` (the engine's ``kv``)."""
        if not self.is_registered:
            return
        if self.kv_snapshot_wanted:
            self.kv_snapshot_wanted = False
            self._kv_seq = 0
            self.socket.send(encode(KVEvents(worker_id=self.worker_id, seq=0,
                                             stored=prefix_cache.prefix_cache_snapshot(), full=True)))
            return
        stored, removed = prefix_cache.drain_prefix_cache_events()
        if stored or removed:  # batched by the loop's pace: one message per pass at most
            self._kv_seq += 1
            self.socket.send(encode(KVEvents(worker_id=self.worker_id, seq=self._kv_seq, stored=stored,
                                             removed=removed)))

    def step_started(self) -> None:
        self.step_started_at = time.monotonic()

    def step_finished(self) -> None:
        started, self.step_started_at = self.step_started_at, None
        if started is not None:
            self._num_steps += 1
            self._max_step_s = max(self._max_step_s, time.monotonic() - started)

    def is_load_stale(self) -> bool:
        """Whether the next heartbeat would report a load older than half a heartbeat interval."""
        return time.monotonic() - self._load_at >= self.heartbeat_interval_s / 2

    def update_load(self, load: WorkerLoad) -> None:
        """The load the next heartbeat reports."""
        self.load = load
        self._load_at = time.monotonic()

    def report_now(self, load: WorkerLoad) -> None:
        """Send ``load`` at once, in order with the token batches, instead of at the next heartbeat (a worker
        that starts to drain: the router stops routing here before anything else fails on it)."""
        self.update_load(load)
        if self.is_registered:
            self.send(Heartbeat(worker_id=self.worker_id, load=self._heartbeat_load(time.monotonic())))

    def close(self) -> None:
        self._stopping = True
        self._thread.join(timeout=5)
        self.socket.close(linger=0)

    # -------------------------------------------------------------- I/O thread
    def _main(self) -> None:
        poller = zmq.Poller()
        poller.register(self._dealer.socket, zmq.POLLIN)
        poller.register(self._io_end, zmq.POLLIN)
        last_register = last_heartbeat = 0.0
        unanswered_since = warned_at = time.monotonic()
        try:
            while not self._stopping:
                for sock, _ in poller.poll(50):
                    if sock is self._dealer.socket:
                        self._read_router()
                    else:
                        self._forward_outputs()
                now = time.monotonic()
                if not self.is_registered:
                    if now - last_register >= REGISTER_RETRY_S:
                        self._send_unless_no_route(self.registration)
                        last_register = now
                    if now - warned_at >= UNANSWERED_WARN_S:
                        self._warn_unanswered(now - unanswered_since)
                        warned_at = now
                else:
                    unanswered_since = warned_at = now
                    if now - last_heartbeat >= self.heartbeat_interval_s:
                        self._send_unless_no_route(Heartbeat(worker_id=self.worker_id, load=self._heartbeat_load(now)))
                        last_heartbeat = now
                self._watch_for_stall(now)
                self._sign_of_life.beat(now)
        except Exception:
            logger.exception("router link thread failed")
            self._rejection = "the router link thread failed (see the log)"
        finally:
            self._dealer.close(linger=0)
            self._io_end.close(linger=0)

    def _send_unless_no_route(self, message) -> None:
        """Registrations and heartbeats are sent again on time: one that cannot leave now (no connection to queue
        it on: a router whose security does not match this worker's refused the handshake, and libzmq keeps
        no pipe to it) is skipped, not waited for (a blocking send would stop this thread, warnings included)."""
        try:
            self._dealer.send(message, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _warn_unanswered(self, seconds: float) -> None:
        """Registering without an answer: a router that is not there yet, or one that refuses this worker's
        connection before any message (another cluster key), which only the router's log would say otherwise."""
        hint = (" On tcp:// the worker must hold the router's cluster key (--cluster-key-file), or both run "
                "--insecure-cluster: a worker with another key, or none, is refused before any message, and only "
                "the router logs it."
                if self._router_endpoint.startswith("tcp://") else "")
        logger.warning("worker %s: no answer from the router at %s for %.0f s; still trying. Is it running?%s",
                       self.worker_id, self._router_endpoint, seconds, hint)

    def _read_router(self) -> None:
        has_requests = False
        for message, _, _ in self._dealer.receive_ready():
            if isinstance(message, RegisterAck):
                self._on_ack(message)
            else:
                self._inbox.append(message)
                has_requests = True
        if has_requests or self._rejection is not None:
            try:
                self._io_end.send(b"", zmq.NOBLOCK)  # wake the loop
            except zmq.Again:
                pass  # a thousand wake-ups are already queued: the loop will look

    def _forward_outputs(self) -> None:
        while True:
            try:
                frame = self._io_end.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._dealer.send_frames([frame])

    def _on_ack(self, ack: RegisterAck) -> None:
        if ack.accepted:
            if not self.is_registered:
                logger.info("registered with the router as %s", self.worker_id)
                self.kv_snapshot_wanted = True  # the router's index of this worker starts empty
            self.is_registered = True
            # The router says how often it needs a sign of life; a worker configured to report more often may.
            self.heartbeat_interval_s = min(ack.heartbeat_interval_s, self.max_heartbeat_interval_s)
        elif ack.reregister:
            self.is_registered = False
        else:
            self._rejection = ack.error or "rejected"

    def _heartbeat_load(self, now: float) -> WorkerLoad:
        load = msgspec.structs.replace(self.load, num_steps=self._num_steps, max_step_s=self._max_step_s)
        started = self.step_started_at
        if started is not None:
            load.busy_in_step_s = now - started
        return load

    def _watch_for_stall(self, now: float) -> None:
        started = self.step_started_at
        if self.step_stall_timeout_s is None or started is None or now - started <= self.step_stall_timeout_s:
            return
        logger.critical("worker %s: one engine step has run for %.0f s (step_stall_timeout_s=%g): the engine is "
                        "wedged; exiting with code %d so that the launcher restarts it", self.worker_id,
                        now - started, self.step_stall_timeout_s, STALL_EXIT_CODE)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(STALL_EXIT_CODE)
