"""Control-plane messages between the router and workers (the decode <-> prefill ones are in
``pipeline/protocol/prefill_decode.py``, re-exported here).

Sockets and who speaks on them (every frame is one msgpack-encoded tagged struct, never pickle):

1. worker DEALER (routing id = ``worker_id``) -> router ROUTER at ``router_endpoint(base)``:
   ``WorkerToRouter`` = RegisterWorker | Heartbeat | TokenBatch | KVEvents | HandoffOffer; decode with
   ``decode_worker_to_router``. A prefill worker's TokenBatch carries first tokens only (streamed while
   the decode worker still verifies their KV; the router drops the decode worker's copy).
2. router ROUTER -> worker DEALER, same connection: ``RouterToWorker`` = GenerateRequest | CancelRequest |
   RegisterAck | HandoffDeclined | WarmPrefix | StartPrefill; decode with ``decode_router_to_worker``.
3. decode <-> prefill (``DecodeToPrefill``, ``PrefillToDecode``, and the transfer's ``PrefillDone`` payload):
   ``pipeline/protocol/prefill_decode.py``. Every message of both modules is encoded with ``encode``.

Live migration on drain (decode_worker/kv_handoff.py): a draining DecodeOnly worker D1 pauses each
decoding stream and sends ``HandoffOffer``. The router declines (``HandoffDeclined``: D1 decodes it on)
or sends another DecodeOnly worker D2 a ``GenerateRequest`` whose ``prefill_endpoint`` is D1's handoff
socket, with the tokens sent so far (``resume_token_ids``) and D1's id for the stream
(``kv_source_request_id``). D2 reserves blocks and asks D1 as it would ask a prefill worker; D1 pushes
the stream's KV and a ``PrefillDone`` whose ``first_token_id`` is the last token sent (not emitted
again): D2 decodes on from there, nothing recomputed.

Worker lifecycle towards the router: connect, send ``RegisterWorker``, wait for ``RegisterAck``
(accepted: heartbeat every ``heartbeat_interval_s``; rejected with ``reregister``: send RegisterWorker
again; rejected otherwise: log ``error`` and exit). A worker silent for the router's dead-after window
is declared dead: its requests fail (or are retried elsewhere before their first token) and it gets
no new work until it heartbeats or registers again. Any message from a worker counts as a sign of life.

A frame that fails to decode raises ``msgspec.DecodeError`` (``msgspec.ValidationError`` is a subclass):
the receiver counts it, logs it and drops it. Structs on the per-token path are ``array_like`` (a
msgpack array, the tag first), ``omit_defaults`` (trailing defaults are not sent) and ``gc=False``.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Union

import msgspec

from pipeline.config import PipelineRole
from pipeline.protocol.prefill_decode import (CancelPrefill, DecodeToPrefill, PrefillAccepted, PrefillDone,
                                              PrefillRejected, PrefillRequest, PrefillStarted, PrefillToDecode,
                                              decode_decode_to_prefill, decode_prefill_done, decode_prefill_to_decode)
from pipeline.protocol.requests import HOT_PATH_STRUCT, FinishReason, PromptLogprobs, SamplingParams, TokenLogprob

PROTOCOL_VERSION = 1
BUILTIN_MODEL_NAME = "tandem-builtin"
DEFAULT_DEADLINE_S = 600.0


def served_model_name(model_path: str | None) -> str:
    """The model name the router serves and workers register with: the checkpoint dir's basename."""
    if not model_path:
        return BUILTIN_MODEL_NAME
    return Path(str(model_path).rstrip("/")).name or BUILTIN_MODEL_NAME


def served_names(names: str | None, checkpoint_name: str) -> list[str]:
    """The names clients ask for, first the one responses show: ``model.served_model_name`` (comma-separated),
    else the name workers register with."""
    return [n.strip() for n in (names or "").split(",") if n.strip()] or [checkpoint_name]


class WorkerRole(enum.IntEnum):
    """PipelineRole as a wire code."""

    PREFILL_AND_DECODE = 0
    PREFILL_ONLY = 1
    DECODE_ONLY = 2

    @classmethod
    def from_pipeline_role(cls, role: PipelineRole) -> "WorkerRole":
        return _ROLE_TO_CODE[PipelineRole(role)]

    def to_pipeline_role(self) -> PipelineRole:
        return _CODE_TO_ROLE[self]


_ROLE_TO_CODE = {
    PipelineRole.PrefillAndDecode: WorkerRole.PREFILL_AND_DECODE,
    PipelineRole.PrefillOnly: WorkerRole.PREFILL_ONLY,
    PipelineRole.DecodeOnly: WorkerRole.DECODE_ONLY,
}
_CODE_TO_ROLE = {code: role for role, code in _ROLE_TO_CODE.items()}


class FinishCode(enum.IntEnum):
    """Why a request finished, as a wire code (``FinishReason`` is its string form)."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_length reached
    ABORT = 2  # cancelled (CancelRequest, shutdown)
    ERROR = 3  # failed; see TokenDelta.error / retryable

    def to_finish_reason(self) -> FinishReason:
        return FinishReason[self.name]


_HOT = HOT_PATH_STRUCT


# ---------------------------------------------------------------- worker -> router


class RegisterWorker(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, kw_only=True):
    """First message on a worker's DEALER; sent again after a rejection with ``reregister``."""

    worker_id: str  # must equal the DEALER's routing id
    role: WorkerRole
    model_name: str  # served_model_name(config.model.model_path); must match the router's
    max_length: int  # prompt + output tokens this worker accepts
    page_size: int  # tokens per KV block
    num_total_blocks: int
    prefill_endpoint: str | None = None  # PrefillOnly: where decode workers connect (LAST_ENDPOINT)
    pid: int = 0
    protocol_version: int = PROTOCOL_VERSION
    max_batch_size: int = 0  # requests this worker runs at once (0: unknown); the router admits up to it
    rank_pids: list[int] = msgspec.field(default_factory=list)  # tensor parallelism: ranks 1..N-1 (pid: rank 0)


class WorkerLoad(msgspec.Struct, **_HOT):
    """A worker's load; counters named ``transfer_*`` and ``num_bad_frames`` are cumulative since start.

    ``num_used_blocks`` counts blocks held by live requests; prefix-cached blocks that no request holds
    count as free.
    """

    num_queued_prefill_tokens: int = 0  # prompt tokens waiting for (or in) prefill
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_used_blocks: int = 0
    num_total_blocks: int = 0
    transfer_bytes: int = 0
    transfer_count: int = 0  # KV transfers finished (one per request that went through a prefill worker)
    transfer_seconds: float = 0.0  # first block to acknowledgement, summed (a receiver's includes the prefill)
    num_bad_frames: int = 0
    busy_in_step_s: float = 0.0  # how long the current engine step has run (0: between steps)
    num_steps: int = 0  # engine steps completed since start
    max_step_s: float = 0.0  # the longest engine step so far
    num_prompt_tokens_computed: int = 0  # prompt tokens run through the model since start (prefix-cache hits not)
    is_draining: bool = False  # shutting down: route nothing new here
    # speculative decoding, cumulative (vLLM's spec_decode counters); empty per-position list when off
    spec_num_drafts: int = 0  # verify steps of one request with at least one draft token
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = msgspec.field(default_factory=list)
    num_warmup_tokens_computed: int = 0  # tokens prefix warm-ups ran through the model since start (WarmPrefix)
    num_handshakes_refused: int = 0  # CURVE handshakes refused on this worker's own sockets (pipeline.security)
    transfer_busy_seconds: float = 0.0  # of transfer_seconds, the time spent moving bytes (the transport's own)
    # prefill worker: early prefills (StartPrefill) no decode worker claimed within the hold; a claim that came
    # later ran as a new prompt, its KV from the prefix cache but the last (partial) block computed again
    num_early_prefills_unclaimed: int = 0


class Heartbeat(msgspec.Struct, tag=True, **_HOT):
    worker_id: str
    load: WorkerLoad


class TokenDelta(msgspec.Struct, **_HOT):
    """New tokens of one request since the last TokenBatch; the last one carries ``finish_reason``.

    ``token_ids`` includes a final stop token (EOS or one of ``stop_token_ids``); ``stop_token_id``
    then names it so the router can leave its text out. ``logprobs[i]`` belongs to ``token_ids[i]``:
    the sampled token first, then the top-N. ``num_prompt_tokens`` / ``num_cached_tokens`` may be sent
    once (any delta); the router keeps the largest value seen.
    """

    request_id: str
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[list[TokenLogprob]] | None = None
    finish_reason: FinishCode | None = None
    error: str | None = None
    retryable: bool = False  # with ERROR: nothing was emitted and another worker may succeed
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    stop_token_id: int | None = None
    is_eos: bool = False  # with stop_token_id: an EOS (stop_reason null, as vLLM has it), not a stop_token_ids one
    is_prefill_failure: bool = False  # with ERROR: the prefill worker's side failed (retry without it)
    prompt_logprobs: PromptLogprobs | None = None  # with the first token, when the request asked for them
    index: int = 0  # which choice (n > 1); ``finish_reason`` ends that choice, ERROR ends the whole request
    num_migrated_kv_bytes: int = 0  # with the first tokens after a live migration: the KV bytes that came


class TokenBatch(msgspec.Struct, tag=True, **_HOT):
    """One message per decode step, covering every request that produced or finished something."""

    outputs: list[TokenDelta]


class KVEvents(msgspec.Struct, tag=True, **_HOT):
    """What changed in a worker's prefix cache: block hashes (``pipeline.kv_cache.hash_block``) now
    cached and forgotten. ``full``: a snapshot (everything cached now), sent after every registration;
    then batches numbered ``seq`` 1, 2, ... (a gap means lost events: the router asks for a snapshot)."""

    worker_id: str
    seq: int
    stored: list[bytes]
    removed: list[bytes] = msgspec.field(default_factory=list)
    full: bool = False


class HandoffOffer(msgspec.Struct, tag=True, **_HOT):
    """A draining DecodeOnly worker paused stream ``request_id`` after its last token (every token it
    emitted is in earlier TokenBatches on this socket) and offers its KV at ``endpoint``."""

    worker_id: str
    request_id: str
    endpoint: str


WorkerToRouter = Union[RegisterWorker, Heartbeat, TokenBatch, KVEvents, HandoffOffer]


# ---------------------------------------------------------------- router -> worker


class GenerateRequest(msgspec.Struct, tag=True, **_HOT):
    """Router -> decode-capable worker. ``prefill_endpoint`` None: the decode worker prefills itself."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prefill_worker_id: str | None = None
    prefill_endpoint: str | None = None
    deadline_s: float = DEFAULT_DEADLINE_S  # seconds from receipt; then finish with ERROR (clock-skew free)
    # a migrated stream: the output tokens the client already has (the worker recomputes their KV and
    # goes on after them), or, with ``kv_source_request_id``, receives their KV from the draining decode
    # worker at ``prefill_endpoint`` that holds the stream under that id
    resume_token_ids: list[int] = msgspec.field(default_factory=list)
    kv_source_request_id: str | None = None
    priority: int = 0  # vLLM's: lower is served first (``scheduling_policy = "priority"``); last, so old frames decode
    # W3C trace context (``traceparent``, ``tracestate``) of the router's request span, so the workers' spans
    # join the request's trace (pipeline/tracing); None when tracing is off. Last, so old frames decode
    trace_context: dict[str, str] | None = None


class CancelRequest(msgspec.Struct, tag=True, **_HOT):
    """Stop a request and free its blocks; the worker may answer with a final ABORT delta or nothing.
    ``index``: stop only that choice of an n > 1 request (the router ended it on a stop string)."""

    request_id: str
    index: int | None = None


class RegisterAck(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, kw_only=True):
    """Answer to RegisterWorker, or to a Heartbeat from a worker the router does not know."""

    accepted: bool
    error: str | None = None
    reregister: bool = False  # the router lost track of this worker: send RegisterWorker again
    heartbeat_interval_s: float = 0.5  # how often the router expects a Heartbeat


class HandoffDeclined(msgspec.Struct, tag=True, **_HOT):
    """No other worker takes the offered stream (or the router no longer knows it): decode it on here."""

    request_id: str
    reason: str = ""


class WarmPrefix(msgspec.Struct, tag=True, **_HOT):
    """Router -> prefill worker, as a disaggregated request ends: compute the KV of these tokens (its prompt
    and answer) into the prefix cache in idle steps, so the conversation's next turn computes only what is
    new (``pipeline/prefix_warmup.py``). Best effort: nothing answers it."""

    token_ids: list[int]
    num_prompt_tokens: int = 0  # the leading tokens (the request's prompt) the prefill worker computed


class StartPrefill(msgspec.Struct, tag=True, **_HOT):
    """Router -> prefill worker, beside the ``GenerateRequest`` to the decode worker: start the prompt now.
    The decode worker's ``PrefillRequest`` for the same ``request_id`` (its destination blocks) joins the
    computation under way, or finds it done, instead of waiting for its own turn. Best effort: nothing
    answers it; unclaimed, it ends after a short hold and leaves its KV in the prefix cache."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0  # the request's (GenerateRequest.priority): the prefill worker's queue order
    trace_context: dict[str, str] | None = None  # the request's (GenerateRequest.trace_context)


RouterToWorker = Union[GenerateRequest, CancelRequest, RegisterAck, HandoffDeclined, WarmPrefix, StartPrefill]


# ---------------------------------------------------------------- codecs

_encoder = msgspec.msgpack.Encoder()
_worker_to_router = msgspec.msgpack.Decoder(WorkerToRouter)
_router_to_worker = msgspec.msgpack.Decoder(RouterToWorker)


def encode(message: msgspec.Struct) -> bytes:
    """Encode any message in this module (and PrefillDone) to one frame."""
    return _encoder.encode(message)


encode_prefill_done = encode


def decode_worker_to_router(frame: bytes | memoryview) -> RegisterWorker | Heartbeat | TokenBatch | KVEvents | HandoffOffer:
    return _worker_to_router.decode(frame)


def decode_router_to_worker(
    frame: bytes | memoryview,
) -> GenerateRequest | CancelRequest | RegisterAck | HandoffDeclined | WarmPrefix:
    return _router_to_worker.decode(frame)


__all__ = [
    "PROTOCOL_VERSION", "BUILTIN_MODEL_NAME", "DEFAULT_DEADLINE_S", "served_model_name",
    "WorkerRole", "FinishCode",
    "RegisterWorker", "WorkerLoad", "Heartbeat", "TokenDelta", "TokenBatch", "KVEvents", "HandoffOffer", "WorkerToRouter",
    "GenerateRequest", "CancelRequest", "RegisterAck", "HandoffDeclined", "WarmPrefix", "StartPrefill", "RouterToWorker",
    "PrefillRequest", "CancelPrefill", "PrefillRejected", "PrefillAccepted", "PrefillStarted", "DecodeToPrefill", "PrefillToDecode", "PrefillDone",
    "encode", "encode_prefill_done", "decode_worker_to_router", "decode_router_to_worker",
    "decode_decode_to_prefill", "decode_prefill_to_decode", "decode_prefill_done",
]
