"""The one background thread of a sender or receiver: it owns every ZMQ socket and all mutable state.

Public methods run on the caller's thread and only enqueue commands; the I/O thread runs them between
messages, so no lock guards transfer state and no socket is touched by two threads. ``close()`` is
deterministic: it stops the loop, the thread closes its sockets (waiting at most 200 ms to deliver
goodbyes for requests still in flight) and exits, and ``close()`` joins it before returning.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from typing import Callable

import torch
import zmq

log = logging.getLogger(__name__)


class IOThread:
    """Subclasses implement ``_setup``, ``_on_readable(socket)``, ``_tick(now) -> seconds until next
    deadline or None`` and ``_teardown``; they register sockets with ``self.poller``."""

    def __init__(self, name: str, num_torch_threads: int = 1) -> None:
        self.ctx = zmq.Context()
        self._num_torch_threads = num_torch_threads
        self.poller = zmq.Poller()
        self._commands: collections.deque[tuple[Callable, tuple]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self._stopping = False
        self._closed = False
        self._failure: BaseException | None = None
        self._ready = threading.Event()
        self._reported = threading.Event()  # set by the I/O thread each time it reports a result (or fails)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.inbox_read_at = time.monotonic()  # I/O thread: when its sockets were last polled and read

    # ---- caller side ---------------------------------------------------------------------------

    def _start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:  # e.g. the bind address is taken: clean up, raise the original error
            failure = self._failure
            self._stop()
            raise failure

    def _submit(self, fn: Callable, *args) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        self._raise_if_failed()
        self._commands.append((fn, args))
        self._wake()

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"{type(self).__name__} I/O thread failed: {self._failure!r}") from self._failure

    def _wait_for_results(self, has_results: Callable[[], bool], timeout_s: float) -> None:
        """Block until ``has_results()`` or ``timeout_s`` passed (or the I/O thread failed): ``poll``'s wait."""
        deadline = time.monotonic() + timeout_s
        while not has_results() and self._failure is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._reported.wait(remaining)
            self._reported.clear()  # a stale wake-up only costs one more look at has_results()

    def _stop(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        self._wake()
        if self._thread.ident is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("%s: I/O thread did not stop within %.1fs", type(self).__name__, timeout)
                return  # leave the context and pipe to the thread; it is a daemon
        self.ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is already full (so the thread will wake) or closed

    # ---- I/O thread ----------------------------------------------------------------------------

    def _main(self) -> None:
        # Per-thread (OpenMP) setting: the worker's own torch ops keep their threads, and small per-block
        # copies here do not wake a whole thread team on every call.
        torch.set_num_threads(self._num_torch_threads)
        try:
            self._setup()
        except BaseException as exc:  # reported to the constructor by _start
            self._failure = exc
            self._ready.set()
            self._teardown()
            return
        self._ready.set()
        try:
            while not self._stopping:
                self._run_commands()
                delay = self._tick(time.monotonic())
                timeout_ms = 100 if delay is None else 0 if delay <= 0 else min(100, math.ceil(delay * 1000))
                for sock, _ in self.poller.poll(timeout_ms):
                    if sock == self._wake_r:
                        self._drain_wake()
                    else:
                        self._on_readable(sock)
                self.inbox_read_at = time.monotonic()
        except BaseException as exc:
            log.exception("%s: I/O thread crashed", type(self).__name__)
            self._failure = exc
            self._reported.set()
        finally:
            self._teardown()

    def _run_commands(self) -> None:
        while self._commands:
            fn, args = self._commands.popleft()
            fn(*args)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _setup(self) -> None:
        raise NotImplementedError

    def _on_readable(self, sock: zmq.Socket) -> None:
        raise NotImplementedError

    def _tick(self, now: float) -> float | None:
        raise NotImplementedError

    def _teardown(self) -> None:
        raise NotImplementedError
