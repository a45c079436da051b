"""The prefill worker (PrefillOnly role): prompts in, KV and first tokens out.

Request lifecycle on this worker:

1. ``PrefillRequest`` arrives from a decode worker D on this worker's ROUTER socket, carrying D's
   destination block ids and transfer endpoint. It joins the engine as a prefill-only request
   (it stops after the first token and keeps its blocks). A full queue answers ``PrefillRejected``
   (retryable). Usually the router's ``StartPrefill`` came first, as it sent the request to D: the
   prompt is then under way (or done) already, and D's request claims it. An early prefill nobody
   claims ends ``EARLY_PREFILL_HOLD_S`` after it arrived, leaving its KV in the prefix cache.
2. Batched chunked prefill under ``max_batch_input_tokens``; this worker's own prefix cache skips
   compute for prompts it has seen (and for answers it was asked to warm up: ``WarmPrefix`` from the
   router as a request ends, computed in idle steps, ``pipeline/prefix_warmup.py``).
   ``PrefillAccepted`` answers at once; when the request's first chunk has run, ``PrefillStarted``
   tells D and the TTL starts on both sides (time queued here behind other prompts is load, not a fault).
3. After every step, blocks that became complete are pushed to D at once, so the transfer overlaps
   the next chunk's compute. Blocks D already holds (its own prefix hit) are not sent.
4. When the prompt is done, the last (partial) block follows, then ``PrefillDone`` (first token,
   logprobs) as the completion payload on the same ordered channel. The first token also goes straight
   to the router, which streams it at once (``first_token_delta``): the client need not wait for D to
   verify the KV between two of its decode steps. D still emits it; the router keeps one of the two.
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

import zmq

from kv_transfer.layout import kv_layout
from kv_transfer.sender import KVSender
from pipeline.config import PipelineConfig
from pipeline.endpoints import worker_bind_endpoint
from pipeline.engine import RequestError, StepOutput
from pipeline.protocol.cluster import (
    CancelPrefill,
    DecodeToPrefill,
    PrefillAccepted,
    PrefillDone,
    PrefillRejected,
    PrefillRequest,
    PrefillStarted,
    StartPrefill,
    TokenDelta,
    WarmPrefix,
    decode_decode_to_prefill,
    encode,
)
from pipeline.protocol.typed_socket import TypedSocket
from pipeline.scheduler import QueueFullError
from pipeline.worker_base import WorkerBase, logprobs_to_wire, transfer_counters

logger = logging.getLogger(__name__)

# How long an early prefill (``StartPrefill``) waits for its decode worker's claim. The claim normally
# follows within a decode step; one that comes later (D's batch was full) finds the KV in the prefix cache.
EARLY_PREFILL_HOLD_S = 2.0


@dataclass
class PrefillJob:
    request: PrefillRequest | None  # None: started early (``early``), no decode worker has claimed it yet
    decode_identity: bytes | None
    deadline: float  # the TTL, counted from the first chunk (a job queued here waits for its turn)
    num_sent_blocks: int  # leading destination blocks already sent (or already on D)
    is_finished: bool = False  # PrefillDone handed to the sender
    is_dropped: bool = False
    has_sent: bool = False  # the sender knows this request (so it will report it once)
    is_started: bool = False  # its first chunk ran and the decode worker was told (PrefillStarted)
    early: StartPrefill | None = None  # the router's early start, until a decode worker claims it
    early_output: StepOutput | None = None  # an unclaimed early prefill's result, kept for the claim


class PrefillWorker(WorkerBase):
    def __init__(self, config: PipelineConfig, worker_id: str) -> None:
        super().__init__(config, worker_id)
        self.requests: TypedSocket[DecodeToPrefill] = TypedSocket(self.ctx, zmq.ROUTER, decode_decode_to_prefill,
                                                                  "prefill socket", logger=logger)
        # Per incarnation (pid): a restarted worker must not receive what decode workers queued for its predecessor.
        address = worker_bind_endpoint(config.zmq_endpoint_base, worker_id, f"prefill-{os.getpid()}",
                                       host=config.resolved_bind_host())
        self.endpoint = self.requests.bind(address)
        layout = kv_layout(self.engine.kv_cache, self.model_fingerprint, config.transfer.transport)
        self.sender = KVSender(self.engine.kv_cache, layout, kernel_backend=config.kernel_backend)
        self.jobs: dict[str, PrefillJob] = {}
        self.connect_router(prefill_endpoint=self.endpoint)

    def listen_endpoints(self) -> list[str]:
        return [self.endpoint]

    def sockets(self) -> list[zmq.Socket]:
        return [self.link.socket, self.requests.socket]

    def transfer_counters(self) -> dict:
        return transfer_counters(self.sender.stats(), self.link.num_bad_frames + self.requests.num_bad_frames)

    # ------------------------------------------------------------------ loop
    def run_once(self) -> None:
        for message in self.link.receive():
            if isinstance(message, WarmPrefix) and not self.is_draining:
                self.engine.warm_prefix(message.token_ids, message.num_prompt_tokens)
            elif isinstance(message, StartPrefill) and not self.is_draining:
                self._start_early(message)
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
        for message, identity, _ in self.requests.receive_ready():
            if isinstance(message, CancelPrefill):
                self._drop(message.request_id, "cancelled by the decode worker")
            else:
                self._accept(identity, message)

    def _start_early(self, start: StartPrefill) -> None:
        """The router's early start: prefill now, for the decode worker's ``PrefillRequest`` to claim."""
        if start.request_id in self.jobs:  # the decode worker's request came first
            return
        try:
            self.engine.add_request(start.request_id, start.prompt_token_ids, start.sampling_params, prefill_only=True)
        except (QueueFullError, RequestError, ValueError):
            return  # the decode worker's own request gets the answer
        self.jobs[start.request_id] = PrefillJob(None, None, time.monotonic() + EARLY_PREFILL_HOLD_S,
                                                 num_sent_blocks=0, early=start)

    def _accept(self, identity: bytes, request: PrefillRequest) -> None:
        rid = request.request_id
        if self.is_draining:
            return self._reject(identity, rid, f"prefill worker {self.worker_id} is shutting down", retryable=True)
        job = self.jobs.get(rid)
        if job is not None and job.request is None:
            if (job.early.prompt_token_ids == request.prompt_token_ids
                    and job.early.sampling_params == request.sampling_params):
                return self._claim(job, identity, request)
            self._drop(rid, "the decode worker asked for another prompt than the router started")
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
        self.requests.send(PrefillAccepted(request_id=rid), to=identity)

    def _claim(self, job: PrefillJob, identity: bytes, request: PrefillRequest) -> None:
        """The decode worker's request for a prompt started early: done already, everything ships now (with
        ``PrefillDone``); under way, the blocks computed so far ship with those of the next chunk."""
        rid = request.request_id
        job.request, job.decode_identity, job.early, job.deadline = request, identity, None, float("inf")
        job.num_sent_blocks = request.num_cached_tokens // self.engine.kv_manager.page_size
        self.requests.send(PrefillAccepted(request_id=rid), to=identity)
        seq = self.engine.get_sequence(rid)
        if job.early_output is not None or (seq is not None and seq.num_computed_tokens > seq.num_cached_tokens):
            job.is_started = True  # the TTL starts now, as it would have with the first chunk
            job.deadline = time.monotonic() + request.ttl_s
            self.requests.send(PrefillStarted(request_id=rid), to=identity)
        if job.early_output is not None:
            output, job.early_output = job.early_output, None
            self._finish(output)

    def _reject(self, identity: bytes, rid: str, error: str, retryable: bool) -> None:
        self.requests.send(PrefillRejected(request_id=rid, error=error, retryable=retryable), to=identity)

    # --------------------------------------------------------------- shipping
    def _ship_progress(self) -> None:
        """After a step: jobs whose first chunk just ran start their TTL (and tell their decode worker),
        and every block that became complete is pushed (the last, partial one follows in ``_finish``)."""
        plan = self.engine.last_plan
        page_size = self.engine.kv_manager.page_size
        now = time.monotonic()
        for chunk in plan.chunks if plan is not None else []:
            job = self.jobs.get(chunk.seq.request_id)
            if job is None or job.request is None or job.is_finished or job.is_dropped:
                continue  # (unclaimed: ``_claim`` ships what is computed by then)
            if not job.is_started:
                job.is_started = True
                job.deadline = now + job.request.ttl_s
                self.requests.send(PrefillStarted(request_id=job.request.request_id), to=job.decode_identity)
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
        if job.request is None:  # started early and done before its decode worker asked: kept, blocks too
            job.early_output = out
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
        early = first_token_delta(job.request, done, self.engine.eos_token_ids, self.engine.max_length)
        if early is not None:
            self.link.send_outputs([early])

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
            if not job.has_sent and job.decode_identity is not None:
                self._reject(job.decode_identity, rid, reason, retryable=True)
            self._drop(rid, reason)

    def _expire(self) -> None:
        now = time.monotonic()
        for rid, job in list(self.jobs.items()):
            if now > job.deadline and not job.is_dropped:
                self._drop(rid, "no decode worker claimed the early prefill" if job.request is None
                           else "TTL passed before the decode worker acknowledged the KV")

    def close(self) -> None:
        self.sender.close()
        self.requests.close()
        super().close()


def first_token_delta(request: PrefillRequest, done: PrefillDone, eos_token_ids: set[int],
                      max_length: int) -> TokenDelta | None:
    """The first token as the router streams it, sent beside the KV; None when the decode worker must
    decide what it means: the token may end the request (EOS, a stop id, a stop string, a length of 1),
    the request has several choices (they fork on D), or it is a stream moving with its KV."""
    params = request.sampling_params
    token = done.first_token_id
    may_end = (token in eos_token_ids or token in params.stop_token_ids or bool(params.stop)
               or (params.max_tokens is not None and params.max_tokens <= 1)
               or done.num_prompt_tokens + 1 >= max_length)
    if may_end or params.num_sequences != 1 or request.source_request_id is not None:
        return None
    return TokenDelta(request_id=request.request_id, token_ids=[token],
                      logprobs=[done.first_logprobs] if done.first_logprobs is not None else None,
                      num_prompt_tokens=done.num_prompt_tokens, prompt_logprobs=done.prompt_logprobs)
