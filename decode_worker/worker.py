"""The decode worker: DecodeOnly (KV from prefill workers) and PrefillAndDecode (colocated) roles.

Request lifecycle on this worker:

1. ``GenerateRequest`` arrives from the router. Without a ``prefill_endpoint`` (colocated, or the
   fallback when no prefill worker is alive) the engine prefills it itself. With one, it is queued
   for a KV reservation.
2. Reservation: the scheduler admits it under ``kvcache_ce_watermark`` / ``max_batch_size`` by
   reserving blocks for the prompt plus the first token (prefix blocks this worker already holds are
   reused). The transfer receiver is told to expect those blocks, and a ``PrefillRequest`` with the
   destination block ids goes to the chosen prefill worker. A TTL clock starts; the prefill worker's
   ``PrefillAccepted`` stops it (a queue on a busy prefill worker is load, not a fault) and its
   ``PrefillStarted`` (first chunk ran) starts it again for the prefill and the transfer.
3. The prefill worker pushes the KV straight into the reserved blocks and, on the same ordered
   channel, the ``PrefillDone`` payload (first token, logprobs). The receiver verifies sizes and
   checksum; then the request becomes runnable and its first token is emitted at once.
4. Continuous-batch decoding; one ``TokenBatch`` per step for every request that produced a token.
5. Faults: a TTL or request deadline that passes, a rejected prefill or a failed transfer ends the
   request with an error (retryable when no token was emitted yet; a drain that runs out of time marks
   every request retryable, and the router migrates those with tokens). Its blocks are freed only after
   the receiver confirms it will never write them again. ``CancelRequest`` frees everything at once.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import msgspec
import zmq

from decode_worker.prefill_links import PrefillLinks
from kv_transfer.layout import kv_layout
from kv_transfer.receiver import KVReceiver
from pipeline.config import PipelineConfig, PipelineRole
from pipeline.endpoints import worker_bind_endpoint
from pipeline.engine import RequestError, StepOutput
from pipeline.protocol.cluster import (
    CancelPrefill,
    CancelRequest,
    GenerateRequest,
    PrefillAccepted,
    PrefillRequest,
    PrefillStarted,
    decode_prefill_done,
)
from pipeline.scheduler import QueueFullError
from pipeline.worker_base import WorkerBase, delta_from_step, error_delta, transfer_counters

logger = logging.getLogger(__name__)


@dataclass
class RemotePrefill:
    """A request whose prompt another worker prefills."""

    request: GenerateRequest
    ttl_deadline: float = float("inf")  # reset by the prefill worker's PrefillAccepted (no TTL) / PrefillStarted
    is_sent: bool = False
    failure: str | None = None  # set when it is being torn down; reported once the receiver lets go
    retryable: bool = True


class DecodeWorker(WorkerBase):
    def __init__(self, config: PipelineConfig, worker_id: str) -> None:
        self.is_disaggregated = config.pipeline_role is PipelineRole.DecodeOnly
        allocator = self._shared_allocator(config, worker_id) if self.is_disaggregated else None
        super().__init__(config, worker_id, kv_cache_allocator=allocator)
        self.receiver: KVReceiver | None = None
        self.prefill_links: PrefillLinks | None = None
        self.remote: dict[str, RemotePrefill] = {}
        self.deadlines: dict[str, float] = {}
        self.emitted: set[str] = set()  # requests that already sent a token to the router
        if self.is_disaggregated:
            self.receiver = KVReceiver(
                self.engine.kv_cache,
                kv_layout(self.engine.kv_cache, self.model_fingerprint, config.transfer.transport),
                # Per incarnation (pid): a prefill worker must handshake anew with a restarted decode
                # worker (a new cache), never write into its predecessor's mapping.
                worker_bind_endpoint(config.zmq_endpoint_base, worker_id, f"kv-{os.getpid()}",
                                     host=config.resolved_bind_host()),
                kernel_backend=config.kernel_backend,
            )
            self.prefill_links = PrefillLinks(self.ctx, worker_id)
        self.connect_router()

    @staticmethod
    def _shared_allocator(config: PipelineConfig, worker_id: str):
        if config.transfer.transport == "zmq" or config.model.resolved_device() != "cpu":
            return None
        from kv_transfer.shm import allocate_shared_kv_cache, remove_stale_shared_kv_caches

        # A worker killed with SIGKILL cannot remove its cache file; whoever starts next on this host does.
        for path in remove_stale_shared_kv_caches():
            logger.warning("removed a shared KV cache left by a dead process: %s", path)
        return lambda shape, dtype, device: allocate_shared_kv_cache(shape, dtype, f"tandem-{worker_id}")

    # ------------------------------------------------------------------ loop
    def run_once(self) -> None:
        outputs = []
        for message in self.link.receive():
            if isinstance(message, GenerateRequest):
                outputs.extend(self._on_generate(message))
            elif isinstance(message, CancelRequest):
                if message.index is None:
                    self._cancel(message.request_id)
                else:
                    self._cancel_choice(message.request_id, message.index)
        if self.is_disaggregated:
            outputs.extend(self._progress_remote())
        if self.is_busy():
            for step in self.run_step():
                outputs.append(self._delta(step))
        outputs.extend(self._expire_deadlines())
        self.link.send_outputs(outputs)
        self.tick()

    def listen_endpoints(self) -> list[str]:
        return [self.receiver.endpoint] if self.receiver is not None else []

    def sockets(self) -> list[zmq.Socket]:
        extra = self.prefill_links.sockets() if self.prefill_links else []
        return [self.link.socket, *extra]

    def transfer_counters(self) -> dict:
        if self.receiver is None:
            return super().transfer_counters()
        return transfer_counters(self.receiver.stats(), self.link.num_bad_frames + self.prefill_links.num_bad_frames)

    # -------------------------------------------------------------- requests
    def _on_generate(self, request: GenerateRequest) -> list:
        rid = request.request_id
        if self.is_draining:
            return [error_delta(rid, f"worker {self.worker_id} is shutting down", retryable=True)]
        remote = request.prefill_endpoint is not None and self.is_disaggregated
        try:
            self.engine.add_request(rid, request.prompt_token_ids, request.sampling_params, remote_prefill=remote,
                                    resume_token_ids=request.resume_token_ids)
        except QueueFullError as exc:
            return [error_delta(rid, str(exc), retryable=True)]
        except (RequestError, ValueError) as exc:
            return [error_delta(rid, str(exc), retryable=False)]
        self.deadlines[rid] = time.monotonic() + request.deadline_s
        if remote:
            self.remote[rid] = RemotePrefill(request)
        return []

    def fail_in_flight(self, reason: str) -> None:
        outputs = []
        for rid in list(self.deadlines):
            state = self.remote.pop(rid, None)
            if state is not None and state.is_sent:
                self._abandon_transfer(rid, state, notify=True)
            self.engine.abort_request(rid)
            outputs.append(error_delta(rid, reason, retryable=True))  # the router moves it on (migration)
            self._forget(rid)
        self.link.send_outputs(outputs)

    def _cancel(self, request_id: str) -> None:
        state = self.remote.get(request_id)
        if state is not None and state.is_sent:
            # The receiver may still be writing: free the blocks only once it has let go.
            self._tear_down_remote(request_id, state, "cancelled", retryable=False, notify=True)
            return
        self.remote.pop(request_id, None)
        self._forget(request_id)
        self.engine.abort_request(request_id)

    def _cancel_choice(self, request_id: str, index: int) -> None:
        """One choice of an n > 1 request stops (a stop string matched at the router); the others go on."""
        self.engine.abort_choice(request_id, index)
        if not self.engine.get_choices(request_id):  # that was the last one running
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self.deadlines.pop(request_id, None)
        self.emitted.discard(request_id)

    def _delta(self, step: StepOutput):
        self.emitted.add(step.request_id)
        if step.request_finished:
            self._forget(step.request_id)
        return delta_from_step(step)

    # --------------------------------------------------------- remote prefill
    def _progress_remote(self) -> list:
        outputs = []
        now = time.monotonic()
        for seq in self.engine.reserve_remote():
            state = self.remote[seq.request_id]
            state.ttl_deadline = now + self.config.transfer.ttl_s  # until the prefill worker answers
            block_ids = list(self.engine.kv_manager.block_table(seq.request_id))
            self.receiver.expect(seq.request_id, block_ids)
            request = state.request
            self.prefill_links.send(request.prefill_endpoint, PrefillRequest(
                request_id=seq.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                dst_block_ids=block_ids,
                num_cached_tokens=seq.num_cached_tokens,
                transfer_endpoint=self.receiver.endpoint,
                decode_worker_id=self.worker_id,
                ttl_s=self.config.transfer.ttl_s,
            ))
            state.is_sent = True
        for answer in self.prefill_links.receive():
            state = self.remote.get(answer.request_id)
            if state is None:
                continue
            if isinstance(answer, PrefillAccepted):
                state.ttl_deadline = float("inf")  # queued there: load, not a fault
            elif isinstance(answer, PrefillStarted):
                state.ttl_deadline = now + self.config.transfer.ttl_s
            else:
                self._tear_down_remote(answer.request_id, state, f"prefill rejected: {answer.error}",
                                       answer.retryable, notify=False)
        for done in self.receiver.poll():
            outputs.extend(self._on_transfer_done(done))
        return outputs

    def _on_transfer_done(self, done) -> list:
        rid = done.request_id
        state = self.remote.pop(rid, None)
        if state is None:
            return []
        if state.failure is None and done.ok:
            try:
                prefill = decode_prefill_done(done.payload)
            except msgspec.DecodeError as exc:
                state.failure = f"malformed PrefillDone payload: {exc}"
            else:
                first_logprobs = None
                if prefill.first_logprobs is not None:  # sampled first, then top-N: a dict holds both
                    first_logprobs = {lp.token_id: lp.logprob for lp in prefill.first_logprobs}
                step = self.engine.activate_remote(rid, prefill.first_token_id, first_logprobs,
                                                   prefill.prompt_logprobs)
                return [self._delta(step)]
        error = state.failure or f"KV transfer failed: {done.error}"
        self.engine.abort_request(rid)
        self._forget(rid)
        if state.failure == "cancelled":
            return []
        # The prefill side failed it (rejected, timed out, transfer broken): a retry avoids that prefill worker.
        return [error_delta(rid, error, retryable=state.retryable, is_prefill_failure=True)]

    def _tear_down_remote(self, rid: str, state: RemotePrefill, reason: str, retryable: bool, notify: bool) -> None:
        if state.failure is not None:
            return
        state.failure, state.retryable = reason, retryable
        if state.is_sent:
            self._abandon_transfer(rid, state, notify)  # reported by the next poll(); blocks are freed then
        else:
            self.remote.pop(rid, None)
            self.engine.abort_request(rid)
            self._forget(rid)

    def _abandon_transfer(self, rid: str, state: RemotePrefill, notify: bool) -> None:
        """Stop expecting KV for ``rid`` (and, with ``notify``, tell its prefill worker to stop computing)."""
        self.receiver.abort(rid)
        if notify:
            self.prefill_links.send(state.request.prefill_endpoint, CancelPrefill(request_id=rid))

    def _expire_deadlines(self) -> list:
        now = time.monotonic()
        outputs = []
        for rid, state in list(self.remote.items()):
            if state.is_sent and state.failure is None and now > state.ttl_deadline:
                logger.warning("request %s: no KV from the prefill worker within %.1fs", rid, self.config.transfer.ttl_s)
                self._tear_down_remote(rid, state, "prefill timed out", retryable=True, notify=True)
        for rid, deadline in list(self.deadlines.items()):
            if now <= deadline:
                continue
            state = self.remote.get(rid)
            if state is not None:
                self._tear_down_remote(rid, state, "request deadline exceeded", retryable=False, notify=True)
                continue
            self.engine.abort_request(rid)
            self._forget(rid)
            outputs.append(error_delta(rid, "request deadline exceeded", retryable=False))
        return outputs

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        if self.prefill_links is not None:
            self.prefill_links.close()
        super().close()
        if self.is_disaggregated and self.engine.kv_cache is not None:
            from kv_transfer.shm import free_shared_kv_cache, shared_kv_path

            if shared_kv_path(self.engine.kv_cache):
                free_shared_kv_cache(self.engine.kv_cache)

