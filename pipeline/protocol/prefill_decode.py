"""Control-plane messages between decode and prefill workers (and a draining decode worker's handoff socket).

Sockets (every frame one msgpack-encoded tagged struct, encoded with ``pipeline.protocol.cluster.encode``):

1. decode DEALER -> prefill ROUTER at the prefill worker's ``prefill_endpoint``: ``DecodeToPrefill`` =
   PrefillRequest | CancelPrefill; decode with ``decode_decode_to_prefill``. A draining decode worker's handoff
   socket speaks the same (``PrefillRequest.source_request_id``; live migration, ``pipeline/protocol/cluster.py``).
2. prefill ROUTER -> decode DEALER, same connection: ``PrefillToDecode`` = PrefillRejected | PrefillAccepted |
   PrefillStarted; decode with ``decode_prefill_to_decode``.
3. ``PrefillDone`` is not sent on either: it is the completion payload the transfer service delivers after the last
   KV bytes (``decode_prefill_done``).

The router <-> worker messages live in ``pipeline/protocol/cluster.py``, which re-exports these.
"""

from __future__ import annotations

from typing import Union

import msgspec

from pipeline.protocol.requests import HOT_PATH_STRUCT as _HOT
from pipeline.protocol.requests import PromptLogprobs, SamplingParams, TokenLogprob

class PrefillRequest(msgspec.Struct, tag=True, **_HOT):
    """Decode -> prefill: compute this prompt and push its KV into ``dst_block_ids`` at ``transfer_endpoint``.

    The first ``num_cached_tokens`` tokens' KV is already on the decode worker (prefix reuse); the
    prefill worker does not send their full blocks (a block they fill only partly is sent whole).
    ``ttl_s`` without progress ends it: after sending it, until ``PrefillAccepted`` (the prefill worker is
    unreachable); after ``PrefillStarted``, since the last chunk computed (prefill worker) or the last KV
    landed (decode worker).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    dst_block_ids: list[int]
    num_cached_tokens: int
    transfer_endpoint: str
    decode_worker_id: str
    ttl_s: float
    # live migration: the stream's id on the draining decode worker asked; ``prompt_token_ids`` is then
    # the prompt plus every output token, and the KV of all but the last is sent (nothing is computed)
    source_request_id: str | None = None
    priority: int = 0  # the request's (GenerateRequest.priority): the prefill worker's queue order
    trace_context: dict[str, str] | None = None  # the request's (GenerateRequest.trace_context)


class CancelPrefill(msgspec.Struct, tag=True, **_HOT):
    request_id: str


class PrefillRejected(msgspec.Struct, tag=True, **_HOT):
    """Prefill -> decode: the request will not be prefilled (``retryable``: try another prefill worker)."""

    request_id: str
    error: str
    retryable: bool = False


class PrefillAccepted(msgspec.Struct, tag=True, **_HOT):
    """Prefill -> decode: the request is queued on the prefill worker (sent at once on receipt).

    From here until ``PrefillStarted`` no TTL runs: time spent queued behind other prompts on a busy
    prefill worker is load, not a fault (a dead prefill worker is the router's to detect). Without
    it, the decode worker gives up ``ttl_s`` after sending the request (the prefill worker is unreachable).
    """

    request_id: str


class PrefillStarted(msgspec.Struct, tag=True, **_HOT):
    """Prefill -> decode: the request's first chunk ran; the transfer TTL runs again on both sides (from here,
    then from each chunk computed / each piece of KV landed)."""

    request_id: str


DecodeToPrefill = Union[PrefillRequest, CancelPrefill]
PrefillToDecode = Union[PrefillRejected, PrefillAccepted, PrefillStarted]


class PrefillDone(msgspec.Struct, **_HOT):
    """The transfer's completion payload: sent after the last KV bytes on the same ordered channel."""

    request_id: str
    first_token_id: int
    first_logprobs: list[TokenLogprob] | None = None  # sampled first, then top-N
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0  # tokens the prefill worker actually ran (prompt minus cached prefix)
    prefill_worker_id: str = ""
    prompt_logprobs: PromptLogprobs | None = None  # computed here, where the prompt ran
    num_draft_computed_tokens: int | None = None  # live migration: leading tokens whose draft-model KV came too


_decode_to_prefill = msgspec.msgpack.Decoder(DecodeToPrefill)
_prefill_to_decode = msgspec.msgpack.Decoder(PrefillToDecode)
_prefill_done = msgspec.msgpack.Decoder(PrefillDone)


def decode_decode_to_prefill(frame: bytes | memoryview) -> PrefillRequest | CancelPrefill:
    return _decode_to_prefill.decode(frame)


def decode_prefill_to_decode(frame: bytes | memoryview) -> PrefillRejected | PrefillAccepted | PrefillStarted:
    return _prefill_to_decode.decode(frame)


def decode_prefill_done(payload: bytes | memoryview) -> PrefillDone:
    return _prefill_done.decode(payload)


__all__ = [
    "PrefillRequest", "CancelPrefill", "PrefillRejected", "PrefillAccepted", "PrefillStarted", "DecodeToPrefill",
    "PrefillToDecode", "PrefillDone", "decode_decode_to_prefill", "decode_prefill_to_decode", "decode_prefill_done",
]
