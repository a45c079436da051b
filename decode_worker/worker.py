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
6. Live migration (DecodeOnly, ``transfer.kv_migration_on_drain``): a draining worker hands its decoding
   streams with their KV to another DecodeOnly worker (``decode_worker/kv_handoff.py``). As the target,
   a ``GenerateRequest`` with ``kv_source_request_id`` goes through steps 2-3 against the draining
   worker, whose ``PrefillDone`` carries the stream's last token (already sent: not emitted again).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import msgspec
import zmq

from decode_worker.kv_handoff import KVHandoff
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
    HandoffDeclined,
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
        self.migrated_bytes: dict[str, int] = {}  # live-migrated streams here: KV bytes that came (reported once)
        self.handoff: KVHandoff | None = None  # draining: streams leave with their KV (live migration)
        if self.is_disaggregated:
            layout = kv_layout(self.engine.kv_cache, self.model_fingerprint, config.transfer.transport)
            if config.transfer.kv_migration_on_drain:
                self.handoff = KVHandoff(worker_id, self.ctx, self.engine, layout, config)
            self.receiver = KVReceiver(
                self.engine.kv_cache,
                layout,
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
            elif isinstance(message, HandoffDeclined) and self.handoff is not None:
                self.handoff.decline(message.request_id)
        if self.is_disaggregated:
            outputs.extend(self._progress_remote())
        # First tokens whose KV just arrived (and errors) go out now, not a step later.
        self.link.send_outputs(outputs)
        outputs = []
        if self.is_busy():
            for step in self.run_step():
                outputs.append(self._delta(step))
        outputs.extend(self._expire_deadlines())
        self.link.send_outputs(outputs)
        if self.handoff is not None:
            self._hand_off_streams()
        self.tick()

    def _hand_off_streams(self) -> None:
        """Draining: pause what decodes and offer it to the router, after its tokens; move the KV of
        streams a target asked for; forget those that left."""
        if self.is_draining:
            steps, paused = self.engine.pause_decoding(skip=self.handoff.recently_declined())
            self.link.send_outputs([self._delta(step) for step in steps])
            self.handoff.offer(self.link, [seq.request_id for seq in paused])
        for stream_id in self.handoff.progress():
            self._forget(stream_id)
    def listen_endpoints(self) -> list[str]:
        return [self.receiver.endpoint] if self.receiver is not None else []

    def sockets(self) -> list[zmq.Socket]:
        extra = self.prefill_links.sockets() if self.prefill_links else []
        handoff = self.handoff.sockets() if self.handoff else []
        return [self.link.socket, *extra, *handoff]

    def has_work_in_flight(self) -> bool:
        return super().has_work_in_flight() or (self.handoff is not None and self.handoff.has_work())

    def transfer_counters(self) -> dict:
        if self.receiver is None:
            return super().transfer_counters()
        num_bad_frames = self.link.num_bad_frames + self.prefill_links.num_bad_frames
        return transfer_counters(self.receiver.stats(), num_bad_frames + (self.handoff.num_bad_frames if self.handoff else 0))

    # -------------------------------------------------------------- requests
    def _on_generate(self, request: GenerateRequest) -> list:
        rid = request.request_id
        if self.is_draining:
            return [error_delta(rid, f"worker {self.worker_id} is shutting down", retryable=True)]
        remote = request.prefill_endpoint is not None and self.is_disaggregated
        if request.kv_source_request_id is not None and not remote:
            return [error_delta(rid, "a live-migrated stream needs a DecodeOnly worker", retryable=True)]
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
        if self.handoff is not None:
            for rid in self.handoff.unsent():  # failed below: the router migrates them by replay
                self.handoff.cancel(rid)
        for rid in list(self.deadlines):
            if self.handoff is not None and self.handoff.owns(rid):  # moving: its target reports it
                self.handoff.cancel(rid)
                self._forget(rid)
                continue
            state = self.remote.pop(rid, None)
            if state is not None and state.is_sent:
                self._abandon_transfer(rid, state, notify=True)
            self.engine.abort_request(rid)
            outputs.append(error_delta(rid, reason, retryable=True))  # the router moves it on (migration)
            self._forget(rid)
        self.link.send_outputs(outputs)

    def _cancel(self, request_id: str) -> None:
        if self.handoff is not None and self.handoff.owns(request_id):
            self.handoff.cancel(request_id)  # its blocks are freed once the sender lets go
            self._forget(request_id)
            return
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
        self.migrated_bytes.pop(request_id, None)

    def _delta(self, step: StepOutput):
        delta = delta_from_step(step)
        delta.num_migrated_kv_bytes = self.migrated_bytes.pop(step.request_id, 0)
        if step.request_finished:
            self._forget(step.request_id)
        return delta

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
                # a live-migrated stream: its prompt and every token sent, whose KV the source holds
                prompt_token_ids=request.prompt_token_ids if request.kv_source_request_id is None else seq.token_ids,
                sampling_params=request.sampling_params,
                dst_block_ids=block_ids,
                num_cached_tokens=seq.num_cached_tokens,
                transfer_endpoint=self.receiver.endpoint,
                decode_worker_id=self.worker_id,
                ttl_s=self.config.transfer.ttl_s,
                source_request_id=request.kv_source_request_id,
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
                if state.request.kv_source_request_id is not None:  # its last token was sent before the move
                    self.engine.activate_migrated(rid, prefill.num_draft_computed_tokens)
                    self.migrated_bytes[rid] = done.num_bytes
                    return []
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
            if self.handoff is not None and self.handoff.owns(rid):
                self.handoff.cancel(rid)  # frees its blocks once no transfer reads them
            else:
                self.engine.abort_request(rid)
            self._forget(rid)
            outputs.append(error_delta(rid, "request deadline exceeded", retryable=False))
        return outputs

    def close(self) -> None:
        if self.handoff is not None:
            self.handoff.close()
        if self.receiver is not None:
            self.receiver.close()
        if self.prefill_links is not None:
            self.prefill_links.close()
        super().close()
        if self.is_disaggregated and self.engine.kv_cache is not None:
            from kv_transfer.shm import free_shared_kv_cache, shared_kv_path

            if shared_kv_path(self.engine.kv_cache):
                free_shared_kv_cache(self.engine.kv_cache)

