"""What every worker process shares: the engine, the router link, the poll loop, output messages.

Roles subclass ``WorkerBase`` and implement ``run_once`` (one pass: read sockets, step the engine
with ``run_step``, send outputs); ``is_busy`` says whether the next pass has work without waiting for
a socket. Heartbeats do not depend on this loop: the router link's own thread sends them, reporting
how long the current step has run (``run_step`` marks steps for it).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import zmq

from pipeline.config import PipelineConfig
from pipeline.engine import LLMEngine, StepOutput
from pipeline.parallel.shard_spec import TensorParallelError
from pipeline.protocol import TokenLogprob
from pipeline.protocol.cluster import FinishCode, RegisterWorker, TokenDelta, WorkerLoad, WorkerRole, served_model_name
from pipeline.router_link import RouterLink
from pipeline.security import num_handshakes_refused

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 5  # how long an idle worker waits on its sockets before checking timers again
_FINISH_CODES = {"stop": FinishCode.STOP, "length": FinishCode.LENGTH, "abort": FinishCode.ABORT,
                 "error": FinishCode.ERROR}


class WorkerBase:
    def __init__(self, config: PipelineConfig, worker_id: str, kv_cache_allocator=None) -> None:
        self.config = config
        self.worker_id = worker_id
        # tensor_parallel_size N: this process is rank 0 and the engine starts ranks 1..N-1 (PipelineConfig
        # refuses N > 1 for PrefillOnly and DecodeOnly: their KV transfer does not move rank slices yet)
        self.engine = LLMEngine(config, kv_cache_allocator=kv_cache_allocator)
        self.model_fingerprint = self.engine.model_fingerprint()
        self.ctx = zmq.Context()
        self.link: RouterLink | None = None
        self.is_draining = False  # SIGTERM: new work is refused (retryable), work in flight finishes

    def connect_router(self, prefill_endpoint: str | None = None) -> None:
        registration = RegisterWorker(
            worker_id=self.worker_id,
            role=WorkerRole.from_pipeline_role(self.config.pipeline_role),
            model_name=served_model_name(self.config.model.model_path),
            max_length=self.engine.max_length,
            page_size=self.engine.kv.page_size,
            num_total_blocks=self.engine.kv.num_total_blocks,
            prefill_endpoint=prefill_endpoint,
            pid=os.getpid(),
            max_batch_size=self.config.max_batch_size,
            rank_pids=self.engine.rank_pids,
        )
        self.link = RouterLink(self.ctx, self.config.zmq_endpoint_base, registration,
                               heartbeat_interval_s=self.config.transfer.heartbeat_interval_s,
                               step_stall_timeout_s=self.config.step_stall_timeout_s)
        self.engine.kv.record_prefix_cache_events()  # the router's KV index follows this worker's prefix cache

    # ------------------------------------------------------------------ loop
    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until ``stop`` is set (or forever), then drain: refuse new work (retryable, so the
        router sends it elsewhere), give what is in flight ``drain_timeout_s`` to finish, fail the
        rest, and close every socket on the way out."""
        if self.link is None:
            self.connect_router()
        stop = stop or threading.Event()
        poller = zmq.Poller()
        registered: set[zmq.Socket] = set()
        drain_deadline = None
        try:
            while True:
                self.engine.check_ranks()  # a tensor-parallel rank that died takes the worker down, even idle
                if stop.is_set() and drain_deadline is None:
                    drain_deadline = time.monotonic() + self.config.drain_timeout_s
                    self.is_draining = True
                    logger.warning("worker %s draining: up to %gs for requests in flight", self.worker_id,
                                   self.config.drain_timeout_s)
                    self.link.report_now(self._load_report())  # the router routes nothing new here from now
                if self.is_draining and not self.has_work_in_flight():
                    break
                if drain_deadline is not None and time.monotonic() > drain_deadline:
                    self.fail_in_flight("the worker shut down before the request finished")
                    break
                for sock in self.sockets():
                    if sock not in registered:
                        poller.register(sock, zmq.POLLIN)
                        registered.add(sock)
                self.run_once()
                if not self.is_busy():
                    poller.poll(IDLE_POLL_MS)
        except TensorParallelError as exc:  # a rank died or hung: the worker exits and is restarted whole
            logger.critical("worker %s: %s; exiting (its launcher restarts it with all its ranks)", self.worker_id, exc)
            self._stop_routing_here_quietly()
            self._fail_in_flight_quietly(f"worker {self.worker_id} lost a tensor-parallel rank")
            self.engine.close_ranks(has_failed=True)  # a hung rank is killed now, not after a grace
            raise
        finally:
            self.close()

    def _stop_routing_here_quietly(self) -> None:
        """Tell the router at once that nothing new may come here (a draining worker's report), so it does not
        send requests to a worker about to exit until it misses its heartbeats; best effort."""
        try:
            self.is_draining = True
            self.link.report_now(self._load_report())
        except Exception:  # noqa: BLE001 - the exit that follows is what matters
            logger.exception("worker %s: could not report that it is going", self.worker_id)

    def _fail_in_flight_quietly(self, reason: str) -> None:
        """Every request here ends retryable (the router migrates them now, not after the heartbeat silence);
        best effort: the engine may be mid-step, and the process exits whatever happens here."""
        try:
            self.fail_in_flight(reason)
        except Exception:  # noqa: BLE001 - the exit that follows is what matters
            logger.exception("worker %s: could not fail its requests in flight", self.worker_id)

    def run_once(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def has_work_in_flight(self) -> bool:
        return self.engine.has_unfinished_requests()

    def fail_in_flight(self, reason: str) -> None:
        """The drain grace is over: end every request still here (roles tell their peers)."""

    def run_step(self) -> list[StepOutput]:
        """One engine step, marked for the heartbeat ("busy in a step since T") and the stall watchdog."""
        self.link.step_started()
        try:
            return self.engine.step()
        finally:
            self.link.step_finished()

    def is_busy(self) -> bool:
        """Whether the engine has runnable work (so the loop must not sleep on its sockets)."""
        return self.engine.has_runnable_work()

    def sockets(self) -> list[zmq.Socket]:
        return [self.link.socket]

    def listen_endpoints(self) -> list[str]:
        """Where peers reach this worker's own listening sockets (for the log); none by default."""
        return []

    def transfer_counters(self) -> dict:
        """Cumulative transfer and bad-frame counters for the load report."""
        return {"num_bad_frames": self.link.num_bad_frames}

    def tick(self) -> None:
        """Send the prefix cache's changes, and refresh the load report the heartbeat thread sends
        (only when the next heartbeat would see an old one: building it walks the queues and
        snapshots the transfer counters)."""
        self.link.send_kv_events(self.engine.kv)
        if not self.link.is_load_stale():
            return
        self.link.update_load(self._load_report())

    def _load_report(self) -> WorkerLoad:
        load = self.engine.load(**self.transfer_counters())
        load.is_draining = self.is_draining
        load.num_handshakes_refused = num_handshakes_refused()  # strangers at its prefill / KV sockets
        return load

    def close(self) -> None:
        try:
            if self.link is not None:
                self.link.close()
            self.ctx.destroy(linger=0)
        finally:  # a forked worker exits with os._exit (no atexit): its ranks are stopped here
            self.engine.close_ranks()


def transfer_counters(stats, num_other_bad_frames: int) -> dict:
    """Load-report counters from a transfer half's ``TransferStats`` plus this worker's own bad frames."""
    return dict(
        transfer_bytes=sum(t.num_bytes for t in stats.transports.values()),
        transfer_count=stats.num_transfers,
        transfer_seconds=sum(t.transfer_seconds for t in stats.transports.values()),
        transfer_busy_seconds=sum(t.busy_seconds for t in stats.transports.values()),
        num_bad_frames=stats.num_bad_frames + num_other_bad_frames,
    )


def logprobs_to_wire(entry: dict[int, float], sampled: int, num_top: int) -> list[TokenLogprob]:
    """The sampled token first, then the top ``num_top`` by descending logprob (which repeat the
    sampled token when it is among them). ``entry`` holds the sampled token and the top N."""
    top = sorted(entry.items(), key=lambda item: -item[1])
    if len(top) > num_top:
        top = [item for item in top if item[0] != sampled][:num_top]
    return [TokenLogprob(sampled, entry[sampled]), *(TokenLogprob(t, lp) for t, lp in top)]


def delta_from_step(step: StepOutput) -> TokenDelta:
    delta = TokenDelta(
        request_id=step.request_id,
        token_ids=step.new_token_ids,
        num_prompt_tokens=step.num_prompt_tokens,
        num_cached_tokens=step.num_cached_tokens,
        prompt_logprobs=step.prompt_logprobs,
        index=step.index,
    )
    if step.new_logprobs is not None:
        delta.logprobs = [logprobs_to_wire(e, t, step.num_top_logprobs)
                          for e, t in zip(step.new_logprobs, step.new_token_ids)]
    if step.finish_reason is not None:
        delta.finish_reason = _FINISH_CODES[step.finish_reason]
        delta.error = step.error
        if step.is_stop_token:
            delta.stop_token_id = step.new_token_ids[-1]  # EOS or a stop token id: no text
            delta.is_eos = step.stop_reason is None  # a stop_token_ids match names its id as the stop reason
    return delta


def error_delta(request_id: str, error: str, retryable: bool, is_prefill_failure: bool = False) -> TokenDelta:
    return TokenDelta(request_id=request_id, finish_reason=FinishCode.ERROR, error=error, retryable=retryable,
                      is_prefill_failure=is_prefill_failure)
