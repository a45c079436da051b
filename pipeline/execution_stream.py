"""ExecutionStream: where a worker's model steps run, one after another, while the host prepares the next.

The overlap pipeline (``pipeline/overlap.py``) launches step N+1 before it reads step N's tokens. That
needs somewhere for step N+1 to run that is ordered after step N and does not block the host thread:

* On CUDA that is a stream, and kernels enqueue asynchronously.
* torch on CPU is synchronous, so here the stream is one background thread taking work in FIFO order.
  Each step still runs after the one before it, and the host thread returns at once to schedule the
  next step, build its inputs and process the previous step's tokens while this step computes.

One thread serves both cases. On CUDA it makes this thread's torch work run on a stream of its own
(``torch.cuda.stream``), so the step does not serialize with the host thread's small input copies on
the default stream. ``submit`` returns a ``Future``, and ``result()`` is the only synchronization
point, so a step's outputs are read exactly when they are needed.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

import torch


class ExecutionStream:
    """A FIFO of step functions run on one thread; ``close`` waits for what was submitted."""

    def __init__(self, device: torch.device | str, name: str = "tandem-execution-stream") -> None:
        self.device = torch.device(device)
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future, Any] | None] = queue.SimpleQueue()
        self._cuda_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._num_threads = torch.get_num_threads()  # OpenMP's thread count is per calling thread: carry it over
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` after everything submitted before it; its result (or exception) in the Future."""
        future: Future = Future()
        ready = None
        if self._cuda_stream is not None:  # the inputs the host thread just copied come first
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self._queue.put((fn, future, ready))
        return future

    def _run(self) -> None:
        torch.set_num_threads(self._num_threads)
        torch.set_grad_enabled(False)
        context = torch.cuda.stream(self._cuda_stream) if self._cuda_stream is not None else None
        if context is not None:
            context.__enter__()
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future, ready = item
            if not future.set_running_or_notify_cancel():
                continue
            if ready is not None:
                self._cuda_stream.wait_event(ready)
            try:
                with torch.inference_mode():
                    result = fn()
                if self._cuda_stream is not None:
                    self._cuda_stream.synchronize()  # outputs are host-ready when the Future resolves
                future.set_result(result)
            except BaseException as exc:  # noqa: BLE001 - the host thread re-raises it from result()
                future.set_exception(exc)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
