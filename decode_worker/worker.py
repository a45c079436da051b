"""The decode worker: DecodeOnly (KV from prefill workers) and PrefillAndDecode (colocated) roles.

Request lifecycle on this worker:

1. ``GenerateRequest`` arrives from the router. Without a ``prefill_endpoint`` (colocated, or the
   fallback when no prefill worker is alive) the engine prefills it itself. With one, it is queued
   for a KV reservation, and steps 2-3 and the TTLs of step 5 are the connector's sink half
   (``kv_transfer/connector/sink.py``: one record per request, ``SinkStatus``); this worker keeps the
   request deadlines and turns the sink's events into token deltas.
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

import zmq

from decode_worker.kv_handoff import KVHandoff
from kv_transfer.connector.setup import ConnectorSetup
from kv_transfer.connector.sink import KVSink
from pipeline import tracing
from pipeline.config import PipelineConfig, PipelineRole
from pipeline.endpoints import worker_bind_endpoint
from pipeline.engine import RequestError, StepOutput
from pipeline.protocol.cluster import CancelRequest, GenerateRequest, HandoffDeclined
from pipeline.scheduler import QueueFullError
from pipeline.worker_base import WorkerBase, delta_from_step, error_delta, transfer_counters

logger = logging.getLogger(__name__)


class DecodeWorker(WorkerBase):
    def __init__(self, config: PipelineConfig, worker_id: str) -> None:
        self.is_disaggregated = config.pipeline_role is PipelineRole.DecodeOnly
        allocator = self._shared_allocator(config, worker_id) if self.is_disaggregated else None
        super().__init__(config, worker_id, kv_cache_allocator=allocator)
        self.sink: KVSink | None = None  # requests whose KV another worker sends
        self.handoff: KVHandoff | None = None  # draining: streams leave with their KV (live migration)
        self.deadlines: dict[str, float] = {}  # every request here: when it must have finished
        # per request: decode > decode.queue (or decode.local_prefill), kv_transfer.receive, decode.decoding
        self.spans = tracing.request_spans()  # no-ops without tracing
        if self.is_disaggregated:
            setup = ConnectorSetup.build(worker_id, self.engine.kv.cache_for_transfer(), self.model_fingerprint,
                                         config.transfer.transport, config.kernel_backend,
                                         self.engine.kv.layer_windows())

            def bind(name: str) -> str:
                # Per incarnation (pid): a peer must handshake anew with a restarted worker (a new cache),
                # never write into its predecessor's mapping.
                return worker_bind_endpoint(config.zmq_endpoint_base, worker_id, f"{name}-{os.getpid()}",
                                            host=config.resolved_bind_host())

            self.sink = setup.open_sink(self.ctx, self.engine.kv, bind("kv"), config.transfer.ttl_s)
            if config.transfer.kv_migration_on_drain:
                self.handoff = KVHandoff(worker_id, self.engine, lambda: setup.open_source(
                    self.ctx, self.engine.kv, bind("handoff"), socket_name="handoff socket", sender_name="kv-handoff",
                    logger=logger), spans=self.spans)
            self._shared_kv_cache = setup.kv_cache
        self.connect_router()

    @staticmethod
    def _shared_allocator(config: PipelineConfig, worker_id: str):
        if config.transfer.transport == "zmq" or config.tensor_parallel_size > 1 or config.model.resolved_device() != "cpu":
            return None  # (several ranks' caches move over ZMQ: kv_transfer/sharded_cache.py)
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
        if self.sink is not None:
            outputs.extend(self._kv_arrivals())
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

    def _kv_arrivals(self) -> list:
        """The sink's progress: first tokens of prompts whose KV arrived, and requests whose KV never will."""
        outputs = []
        for event in self.sink.progress():
            if event.error is not None:  # the prefill side failed it: a retry avoids that prefill worker
                self._forget(event.request_id)
                outputs.append(error_delta(event.request_id, event.error, retryable=event.retryable,
                                           is_prefill_failure=True))
            if event.received is not None:  # the queue ended as the blocks were reserved and the transfer began
                self.spans.transfer(event.request_id, "kv_transfer.receive", "decode", event.received,
                                    ends="decode.queue")
            if event.error is None and event.first_step is not None:
                outputs.append(self._delta(event.first_step))
        return outputs

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
        return [self.sink.endpoint] if self.sink is not None else []

    def sockets(self) -> list[zmq.Socket]:
        extra = self.sink.sockets() if self.sink else []
        handoff = self.handoff.sockets() if self.handoff else []
        return [self.link.socket, *extra, *handoff]

    def has_work_in_flight(self) -> bool:
        return super().has_work_in_flight() or (self.handoff is not None and self.handoff.has_work())

    def transfer_counters(self) -> dict:
        if self.sink is None:
            return super().transfer_counters()
        num_bad_frames = self.link.num_bad_frames + self.sink.num_bad_frames
        return transfer_counters(self.sink.stats(), num_bad_frames + (self.handoff.num_bad_frames if self.handoff else 0))

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
                                    resume_token_ids=request.resume_token_ids, priority=request.priority)
        except QueueFullError as exc:
            return [error_delta(rid, str(exc), retryable=True)]
        except (RequestError, ValueError) as exc:
            return [error_delta(rid, str(exc), retryable=False)]
        self.deadlines[rid] = time.monotonic() + request.deadline_s
        if remote:
            self.sink.expect(request)
        self.spans.start(rid, "decode", parent=request.trace_context, attributes={
            "tandem.request_id": rid, "tandem.num_prompt_tokens": len(request.prompt_token_ids),
            "tandem.remote_prefill": remote, "tandem.num_resumed_tokens": len(request.resume_token_ids),
            "tandem.kv_migration": request.kv_source_request_id is not None})
        self.spans.start(rid, "decode.queue" if remote else "decode.local_prefill", parent="decode")
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
            if self.sink is not None:
                self.sink.abandon(rid)
            self.engine.abort_request(rid)
            outputs.append(error_delta(rid, reason, retryable=True))  # the router moves it on (migration)
            self._forget(rid)
        self.link.send_outputs(outputs)

    def _cancel(self, request_id: str) -> None:
        self._forget(request_id)
        if self.handoff is not None and self.handoff.owns(request_id):
            self.handoff.cancel(request_id)  # its blocks are freed once the sender lets go
        elif self.sink is None or not self.sink.cancel(request_id):  # (the sink frees them once the receiver lets go)
            self.engine.abort_request(request_id)

    def _cancel_choice(self, request_id: str, index: int) -> None:
        """One choice of an n > 1 request stops (a stop string matched at the router); the others go on."""
        self.engine.abort_choice(request_id, index)
        if not self.engine.get_choices(request_id):  # that was the last one running
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self.deadlines.pop(request_id, None)
        self.spans.end_all(request_id)
        if self.sink is not None:
            self.sink.take_migrated_bytes(request_id)

    def _delta(self, step: StepOutput):
        rid = step.request_id
        self.spans.switch(rid, ("decode.queue", "decode.local_prefill"), "decode.decoding", parent="decode")
        self.spans.count(rid, "decode.decoding", "tandem.num_output_tokens", len(step.new_token_ids))
        if step.finish_reason is not None:
            self.spans.count(rid, "decode.decoding", "tandem.num_preemptions", step.num_preemptions)
            if step.request_finished:
                self.spans.set(rid, "decode", {"tandem.finish_reason": step.finish_reason})
        delta = delta_from_step(step)
        if self.sink is not None:
            delta.num_migrated_kv_bytes = self.sink.take_migrated_bytes(step.request_id)
        if step.request_finished:
            self._forget(step.request_id)
        return delta

    def _expire_deadlines(self) -> list:
        now = time.monotonic()
        if self.sink is not None:
            self.sink.expire(now)  # TTLs: reported by the sink's next progress, once the receiver lets go
        outputs = []
        for rid, deadline in list(self.deadlines.items()):
            if now <= deadline:
                continue
            if self.sink is not None and self.sink.tear_down(rid, "request deadline exceeded", retryable=False):
                if not self.sink.owns(rid):
                    self._forget(rid)  # it never got its blocks: ended at once
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
        if self.sink is not None:
            self.sink.close()
        super().close()
        if self.is_disaggregated:
            from kv_transfer.shm import free_shared_kv_cache, shared_kv_path

            if shared_kv_path(self._shared_kv_cache):
                free_shared_kv_cache(self._shared_kv_cache)
