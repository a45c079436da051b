"""The prefill worker (PrefillOnly role): prompts in, KV and first tokens out.

Request lifecycle on this worker:

1. ``PrefillRequest`` arrives from a decode worker D on this worker's ROUTER socket, carrying D's
   destination block ids and transfer endpoint. It joins the engine as a prefill-only request
   (it stops after the first token and keeps its blocks). A full queue answers ``PrefillRejected``
   (retryable).
2. Batched chunked prefill under ``max_batch_input_tokens``; this worker's own prefix cache skips
   compute for prompts it has seen (and for answers it was asked to warm up: ``WarmPrefix`` from the
   router as a request ends, computed in idle steps, ``pipeline/prefix_warmup.py``).
   ``PrefillAccepted`` answers at once; when the request's first chunk has run, ``PrefillStarted``
   tells D and the TTL starts on both sides (time queued here behind other prompts is load, not a fault).
3. After every step, blocks that became complete are pushed to D at once, so the transfer overlaps
   the next chunk's compute. Blocks D already holds (its own prefix hit) are not sent.
4. When the prompt is done, the last (partial) block follows, then ``PrefillDone`` (first token,
   logprobs) as the completion payload on the same ordered channel.
5. Blocks are freed (kept in the prefix cache) only once D acknowledged the verified transfer, or
   at once when the transfer fails, D cancels (``CancelPrefill``) or the request's TTL passes.
   Each step is bounded by ``max_batch_input_tokens``, so cancels, TTLs and shipping are looked at
   between chunks even while a long prompt is encoded.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import msgspec
import zmq

from kv_transfer.layout import kv_layout
from kv_transfer.sender import KVSender
from pipeline.config import PipelineConfig
from pipeline.endpoints import worker_bind_endpoint
from pipeline.engine import RequestError
from pipeline.protocol.cluster import (
    CancelPrefill,
    PrefillAccepted,
    PrefillDone,
    PrefillRejected,
    PrefillRequest,
    PrefillStarted,
    WarmPrefix,
    decode_decode_to_prefill,
    encode,
)
from pipeline.scheduler import QueueFullError
from pipeline.worker_base import WorkerBase, logprobs_to_wire, transfer_counters

logger = logging.getLogger(__name__)


@dataclass
class PrefillJob:
    request: PrefillRequest
    decode_identity: bytes
    deadline: float  # the TTL, counted from the first chunk (a job queued here waits for its turn)
    num_sent_blocks: int  # leading destination blocks already sent (or already on D)
    is_finished: bool = False  # PrefillDone handed to the sender
    is_dropped: bool = False
    has_sent: bool = False  # the sender knows this request (so it will report it once)
    is_started: bool = False  # its first chunk ran and the decode worker was told (PrefillStarted)


class PrefillWorker(WorkerBase):
    def __init__(self, config: PipelineConfig, worker_id: str) -> None:
        super().__init__(config, worker_id)
        self.requests = self.ctx.socket(zmq.ROUTER)
        self.requests.setsockopt(zmq.LINGER, 0)
        # Per incarnation (pid): a restarted worker must not receive what decode workers queued for its predecessor.
        self.requests.bind(worker_bind_endpoint(config.zmq_endpoint_base, worker_id, f"prefill-{os.getpid()}",
                                                host=config.resolved_bind_host()))
        self.endpoint = self.requests.getsockopt(zmq.LAST_ENDPOINT).decode()
        layout = kv_layout(self.engine.kv_cache, self.model_fingerprint, config.transfer.transport)
        self.sender = KVSender(self.engine.kv_cache, layout, kernel_backend=config.kernel_backend)
        self.jobs: dict[str, PrefillJob] = {}
        self.num_bad_frames = 0
        self.connect_router(prefill_endpoint=self.endpoint)

    def listen_endpoints(self) -> list[str]:
        return [self.endpoint]

    def sockets(self) -> list[zmq.Socket]:
        return [self.link.socket, self.requests]

    def transfer_counters(self) -> dict:
        return transfer_counters(self.sender.stats(), self.link.num_bad_frames + self.num_bad_frames)

    # ------------------------------------------------------------------ loop
    def run_once(self) -> None:
        for message in self.link.receive():
            if isinstance(message, WarmPrefix) and not self.is_draining:
                self.engine.warm_prefix(message.token_ids, message.num_prompt_tokens)
            else:
                logger.debug("ignored %s from the router", type(message).__name__)
        self._receive_requests()
        if self.is_busy():
            outputs = self.run_step()
            self._ship_progress()
            for out in outputs:
                if out.finish_reason is not None:
                    self._finish(out)
        self._reap_sends()
        self._expire()
        self.tick()

    def _receive_requests(self) -> None:
        while True:
            try:
                identity, frame = self.requests.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # not two frames
                self.num_bad_frames += 1
                continue
            try:
                message = decode_decode_to_prefill(frame)
            except msgspec.DecodeError as exc:
                self.num_bad_frames += 1
                logger.warning("dropped a malformed frame on the prefill socket (%d so far): %s",
                               self.num_bad_frames, exc)
                continue
            if isinstance(message, CancelPrefill):
                self._drop(message.request_id, "cancelled by the decode worker")
            else:
                self._accept(identity, message)

    def _accept(self, identity: bytes, request: PrefillRequest) -> None:
        rid = request.request_id
        if self.is_draining:
            return self._reject(identity, rid, f"prefill worker {self.worker_id} is shutting down", retryable=True)
        try:
            if rid in self.jobs:
                raise RequestError(f"request {rid} is already being prefilled here")
            self.engine.add_request(rid, request.prompt_token_ids, request.sampling_params, prefill_only=True)
        except QueueFullError as exc:
            return self._reject(identity, rid, str(exc), retryable=True)
        except (RequestError, ValueError) as exc:
            return self._reject(identity, rid, str(exc), retryable=False)
        page_size = self.engine.kv_manager.page_size
        self.jobs[rid] = PrefillJob(request, identity, float("inf"),
                                    num_sent_blocks=request.num_cached_tokens // page_size)
        self.requests.send_multipart([identity, encode(PrefillAccepted(request_id=rid))])

    def _reject(self, identity: bytes, rid: str, error: str, retryable: bool) -> None:
        self.requests.send_multipart([identity, encode(PrefillRejected(request_id=rid, error=error,
                                                                       retryable=retryable))])

    # --------------------------------------------------------------- shipping
    def _ship_progress(self) -> None:
        """After a step: jobs whose first chunk just ran start their TTL (and tell their decode worker),
        and every block that became complete is pushed (the last, partial one follows in ``_finish``)."""
        plan = self.engine.last_plan
        page_size = self.engine.kv_manager.page_size
        now = time.monotonic()
        for chunk in plan.chunks if plan is not None else []:
            job = self.jobs.get(chunk.seq.request_id)
            if job is None or job.is_finished or job.is_dropped:
                continue
            if not job.is_started:
                job.is_started = True
                job.deadline = now + job.request.ttl_s
                self.requests.send_multipart([job.decode_identity,
                                              encode(PrefillStarted(request_id=job.request.request_id))])
            self._send_blocks(job, (chunk.start + chunk.num_tokens) // page_size)  # what that step wrote

    def _send_blocks(self, job: PrefillJob, upto: int) -> None:
        rid = job.request.request_id
        upto = min(upto, len(job.request.dst_block_ids))
        if upto <= job.num_sent_blocks:
            return
        table = self.engine.kv_manager.block_table(rid)
        self.sender.send_blocks(rid, job.request.transfer_endpoint, table[job.num_sent_blocks:upto],
                                job.request.dst_block_ids[job.num_sent_blocks:upto])
        job.num_sent_blocks = upto
        job.has_sent = True

    def _finish(self, out) -> None:
        job = self.jobs.get(out.request_id)
        if job is None or job.is_dropped:
            return
        page_size = self.engine.kv_manager.page_size
        num_prompt_tokens = len(job.request.prompt_token_ids)
        self._send_blocks(job, -(-num_prompt_tokens // page_size))  # the last, partial block too
        first_token = out.new_token_ids[0]
        logprobs = None
        if out.new_logprobs is not None:
            logprobs = logprobs_to_wire(out.new_logprobs[0], first_token, out.num_top_logprobs)
        done = PrefillDone(
            request_id=out.request_id,
            first_token_id=first_token,
            first_logprobs=logprobs,
            num_prompt_tokens=num_prompt_tokens,
            num_computed_tokens=num_prompt_tokens - out.num_cached_tokens,
            prefill_worker_id=self.worker_id,
            prompt_logprobs=out.prompt_logprobs,
        )
        self.sender.finish(out.request_id, encode(done))
        job.is_finished = job.has_sent = True

    def _reap_sends(self) -> None:
        for status in self.sender.poll():
            job = self.jobs.pop(status.request_id, None)
            if not status.ok:
                logger.warning("request %s: KV transfer failed: %s", status.request_id, status.error)
            if job is not None:
                self.engine.abort_request(status.request_id)  # frees (or releases held) blocks

    def _drop(self, rid: str, reason: str) -> None:
        job = self.jobs.get(rid)
        if job is None or job.is_dropped:
            return
        logger.info("request %s dropped: %s", rid, reason)
        job.is_dropped = True
        if not job.has_sent:
            del self.jobs[rid]
            self.engine.abort_request(rid)
            return
        # The sender may still read these blocks: stop computing now, free once it reports back.
        self.engine.abort_request(rid, keep_blocks=True)
        self.sender.abort(rid)

    def has_work_in_flight(self) -> bool:
        return bool(self.jobs) or super().has_work_in_flight()

    def fail_in_flight(self, reason: str) -> None:
        for rid, job in list(self.jobs.items()):
            if not job.has_sent:
                self._reject(job.decode_identity, rid, reason, retryable=True)
            self._drop(rid, reason)

    def _expire(self) -> None:
        now = time.monotonic()
        for rid, job in list(self.jobs.items()):
            if now > job.deadline and not job.is_dropped:
                self._drop(rid, "TTL passed before the decode worker acknowledged the KV")

    def close(self) -> None:
        self.sender.close()
        self.requests.close(linger=0)
        super().close()
