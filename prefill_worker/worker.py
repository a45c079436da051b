"""The prefill worker (PrefillOnly role): prompts in, KV and first tokens out.

Request lifecycle on this worker (the shipping, TTLs, drops and every block's way back are the connector's
source half, ``kv_transfer/connector/source.py``: one record per request, ``SourceStatus``; this worker
decides what to accept and claim and builds ``PrefillDone``):

1. ``PrefillRequest`` arrives from a decode worker D on this worker's ROUTER socket, carrying D's
   destination block ids and transfer endpoint. It joins the engine as a prefill-only request
   (it stops after the first token and keeps its blocks). A full queue answers ``PrefillRejected``
   (retryable). Usually the router's ``StartPrefill`` came first, as it sent the request to D: the
   prompt is then under way (or done) already, and D's request claims it. An early prefill nobody
   claims ends ``router.early_prefill_hold_s`` (2 s) after it arrived, leaving its KV in the prefix cache.
2. Batched chunked prefill under ``max_batch_input_tokens``; this worker's own prefix cache skips
   compute for prompts it has seen (and for answers it was asked to warm up: ``WarmPrefix`` from the
   router as a request ends, computed in idle steps, ``pipeline/prefix_warmup.py``).
   ``PrefillAccepted`` answers at once; when the request's first chunk has run, ``PrefillStarted``
   tells D and the TTL starts on both sides (time queued here behind other prompts is load, not a fault).
3. After every step, blocks that became complete are pushed to D at once, so the transfer overlaps
   the next chunk's compute. Blocks D already holds (its own prefix hit) are not sent.
4. When the prompt is done, the last (partial) block follows, then ``PrefillDone`` (first token,
   logprobs) as the completion payload on the same ordered channel. Before that, the first token goes
   straight to the router, which streams it at once (``first_token_delta``): the client need not wait for
   D to verify the KV between two of its decode steps. D still emits it; the router keeps one of the two
   (the prefill worker's, sent before D can know the prompt is done, unless that message is delayed).
5. Blocks are freed (kept in the prefix cache) only once D acknowledged the verified transfer, or
   at once when the transfer fails, D cancels (``CancelPrefill``) or the request's TTL passes.
   Each step is bounded by ``max_batch_input_tokens``, so cancels, TTLs and shipping are looked at
   between chunks even while a long prompt is encoded.
"""

from __future__ import annotations

import logging
import os
import time

from kv_transfer.connector.setup import ConnectorSetup
from kv_transfer.connector.source import SourceStatus, SourceTransfer
from pipeline import tracing
from pipeline.config import PipelineConfig
from pipeline.endpoints import worker_bind_endpoint
from pipeline.engine import RequestError, StepOutput
from pipeline.protocol.cluster import PrefillDone, PrefillRequest, StartPrefill, TokenDelta, WarmPrefix, encode
from pipeline.scheduler import QueueFullError
from pipeline.worker_base import WorkerBase, logprobs_to_wire, transfer_counters

logger = logging.getLogger(__name__)

class PrefillWorker(WorkerBase):
    def __init__(self, config: PipelineConfig, worker_id: str) -> None:
        super().__init__(config, worker_id)
        # how long an early prefill (``StartPrefill``) waits for its decode worker's claim: the claim normally
        # follows within a decode step; one that comes later (D was in a long step) finds the KV in the prefix cache
        self.early_prefill_hold_s = config.router.early_prefill_hold_s
        setup = ConnectorSetup.build(worker_id, self.engine.kv.cache_for_transfer(), self.model_fingerprint,
                                     config.transfer.transport, config.kernel_backend,
                                     self.engine.kv.layer_windows())
        # Per incarnation (pid): a restarted worker must not receive what decode workers queued for its predecessor.
        self.source = setup.open_source(self.ctx, self.engine.kv, worker_bind_endpoint(
            config.zmq_endpoint_base, worker_id, f"prefill-{os.getpid()}", host=config.resolved_bind_host()),
            logger=logger)
        self.endpoint = self.source.endpoint
        # per request: prefill > prefill.queue, prefill.compute, kv_transfer.send (no-ops without tracing)
        self.spans = tracing.request_spans()
        self.connect_router(prefill_endpoint=self.endpoint)

    @property
    def jobs(self) -> dict[str, SourceTransfer]:
        """Every request this worker prefills or holds for a decode worker (the source's records)."""
        return self.source.transfers

    def listen_endpoints(self) -> list[str]:
        return [self.endpoint]

    def sockets(self):
        return [self.link.socket, self.source.socket.socket]

    def transfer_counters(self) -> dict:
        return {**transfer_counters(self.source.stats(), self.link.num_bad_frames + self.source.num_bad_frames),
                "num_early_prefills_unclaimed": self.source.num_holds_expired}

    # ------------------------------------------------------------------ loop
    def run_once(self) -> None:
        for message in self.link.receive():
            if isinstance(message, WarmPrefix) and not self.is_draining:
                self.engine.warm_prefix(message.token_ids, message.num_prompt_tokens)
            elif isinstance(message, StartPrefill) and not self.is_draining:
                self._start_early(message)
            else:
                logger.debug("ignored %s from the router", type(message).__name__)
        for identity, request in self.source.receive():
            self._accept(identity, request)
        if self.is_busy():
            step_start_ns = time.time_ns()
            outputs = self.run_step()
            written = self.engine.kv_written_last_step()
            self.source.on_kv_written(written)
            for request_id, _ in written:  # its first chunk ran in this step: queued until the step began
                self.spans.switch(request_id, ("prefill.queue",), "prefill.compute", parent="prefill",
                                  at_ns=step_start_ns)
            for out in outputs:
                if out.finish_reason is not None:
                    self._finish(out)
        for job, status in self.source.reap():
            self.spans.transfer(job.request_id, "kv_transfer.send", "prefill", status,
                                num_blocks=job.num_sent_blocks - job.num_skipped_blocks)
            self.spans.end_all(job.request_id)
        self.source.expire()
        self.spans.retain(self.source.transfers)  # dropped, expired: their spans end too
        self.tick()

    def _start_early(self, start: StartPrefill) -> None:
        """The router's early start: prefill now, for the decode worker's ``PrefillRequest`` to claim."""
        if start.request_id in self.source:  # the decode worker's request came first
            return
        try:
            self.engine.add_request(start.request_id, start.prompt_token_ids, start.sampling_params, prefill_only=True,
                                    priority=start.priority)
        except (QueueFullError, RequestError, ValueError):
            return  # the decode worker's own request gets the answer
        self.source.hold(start.request_id, self.early_prefill_hold_s, early=start)
        self._trace_arrival(start.request_id, start.trace_context, len(start.prompt_token_ids), is_early=True)

    def _accept(self, identity: bytes, request: PrefillRequest) -> None:
        rid = request.request_id
        if self.is_draining:
            return self.source.reject(identity, rid, f"prefill worker {self.worker_id} is shutting down", retryable=True)
        job = self.source.get(rid)
        if job is not None and job.status is SourceStatus.UNCLAIMED:
            if (job.early.prompt_token_ids == request.prompt_token_ids
                    and job.early.sampling_params == request.sampling_params):
                return self._claim(job, identity, request)
            self.source.drop(rid, "the decode worker asked for another prompt than the router started")
        try:
            if rid in self.source:
                raise RequestError(f"request {rid} is already being prefilled here")
            self.engine.add_request(rid, request.prompt_token_ids, request.sampling_params, prefill_only=True,
                                    priority=request.priority)
        except QueueFullError as exc:
            return self.source.reject(identity, rid, str(exc), retryable=True)
        except (RequestError, ValueError) as exc:
            return self.source.reject(identity, rid, str(exc), retryable=False)
        self.source.accept(identity, request)
        self._trace_arrival(rid, request.trace_context, len(request.prompt_token_ids), is_early=False)
        self.spans.set(rid, "prefill", {"tandem.decode_worker": request.decode_worker_id,
                                        "tandem.decode_cached_tokens": request.num_cached_tokens})

    def _trace_arrival(self, request_id: str, trace_context: dict | None, num_prompt_tokens: int,
                       is_early: bool) -> None:
        self.spans.start(request_id, "prefill", parent=trace_context, attributes={
            "tandem.request_id": request_id, "tandem.num_prompt_tokens": num_prompt_tokens,
            "tandem.early_prefill": is_early})
        self.spans.start(request_id, "prefill.queue", parent="prefill")

    def _claim(self, job: SourceTransfer, identity: bytes, request: PrefillRequest) -> None:
        """The decode worker's request for a prompt started early: done already, everything ships now (with
        ``PrefillDone``); under way, the blocks computed so far ship with those of the next chunk."""
        rid = request.request_id
        self.source.claim(rid, identity, request)
        self.spans.set(rid, "prefill", {"tandem.decode_worker": request.decode_worker_id,
                                        "tandem.decode_cached_tokens": request.num_cached_tokens})
        seq = self.engine.get_sequence(rid)
        if job.early_output is not None or (seq is not None and seq.num_computed_tokens > seq.num_cached_tokens):
            self.source.start(rid)  # the TTL starts now, as it would have with the first chunk
        if job.early_output is not None:
            output, job.early_output = job.early_output, None
            self._finish(output)

    # --------------------------------------------------------------- shipping
    def _finish(self, out: StepOutput) -> None:
        """A prompt is done: the last (partial) block and ``PrefillDone`` follow its KV; the first token also
        goes straight to the router. An early prefill nobody claimed yet keeps its result (and blocks)."""
        job = self.source.get(out.request_id)
        if job is None or job.status is SourceStatus.DROPPING:
            return
        self.spans.end(out.request_id, "prefill.compute", {"tandem.num_cached_tokens": out.num_cached_tokens,
                                                           "tandem.num_prompt_tokens": out.num_prompt_tokens})
        if job.status is SourceStatus.UNCLAIMED:
            job.early_output = out
            return
        num_prompt_tokens = len(job.request.prompt_token_ids)
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
        early = first_token_delta(job.request, done, self.engine.eos_token_ids, self.engine.max_length)
        if early is not None:  # first: the client's first token waits on no KV, and precedes the decode worker's copy
            self.link.send_outputs([early])
        self.source.finish(out.request_id, encode(done), upto_block=-(-num_prompt_tokens // self.engine.kv.page_size))

    def has_work_in_flight(self) -> bool:
        return self.source.has_work() or super().has_work_in_flight()

    def fail_in_flight(self, reason: str) -> None:
        self.source.fail_all(reason)

    def close(self) -> None:
        self.source.close()
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
