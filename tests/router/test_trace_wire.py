"""``trace_context`` on the wire: GenerateRequest, StartPrefill and PrefillRequest carry it (the decode
worker's sink copies it from the one to the other); frames from processes that predate it decode with
None, and such processes read new frames (the trailing field is ignored)."""

from __future__ import annotations

import msgspec

from pipeline.protocol.cluster import (
    DEFAULT_DEADLINE_S,
    GenerateRequest,
    PrefillRequest,
    StartPrefill,
    decode_decode_to_prefill,
    decode_router_to_worker,
    encode,
)
from pipeline.protocol.requests import SamplingParams

CONTEXT = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tracestate": "k=v"}


class PriorityEraGenerateRequest(msgspec.Struct, tag="GenerateRequest", array_like=True, omit_defaults=True,
                                 gc=False, kw_only=True):
    """GenerateRequest as sent before ``trace_context``: the same tag and fields, in the same order."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prefill_worker_id: str | None = None
    prefill_endpoint: str | None = None
    deadline_s: float = DEFAULT_DEADLINE_S
    resume_token_ids: list[int] = msgspec.field(default_factory=list)
    kv_source_request_id: str | None = None
    priority: int = 0


def test_an_old_frame_decodes_without_trace_context():
    old = PriorityEraGenerateRequest(request_id="r1", prompt_token_ids=[1, 2], sampling_params=SamplingParams(),
                                     priority=3)
    decoded = decode_router_to_worker(encode(old))
    assert isinstance(decoded, GenerateRequest) and decoded.priority == 3 and decoded.trace_context is None


def test_an_old_process_decodes_a_traced_frame():
    frame = encode(GenerateRequest(request_id="r1", prompt_token_ids=[1, 2], sampling_params=SamplingParams(),
                                   priority=2, trace_context=CONTEXT))
    old = msgspec.msgpack.decode(frame, type=PriorityEraGenerateRequest)
    assert old.request_id == "r1" and old.priority == 2


def test_trace_context_round_trips_on_every_message_that_starts_work():
    params = SamplingParams(max_tokens=3)
    generate = GenerateRequest(request_id="r", prompt_token_ids=[1], sampling_params=params, trace_context=CONTEXT)
    start = StartPrefill(request_id="r", prompt_token_ids=[1], sampling_params=params, trace_context=CONTEXT)
    prefill = PrefillRequest(request_id="r", prompt_token_ids=[1], sampling_params=params, dst_block_ids=[0],
                             num_cached_tokens=0, transfer_endpoint="ipc:///x", decode_worker_id="d", ttl_s=1.0,
                             trace_context=CONTEXT)
    assert decode_router_to_worker(encode(generate)).trace_context == CONTEXT
    assert decode_router_to_worker(encode(start)).trace_context == CONTEXT
    assert decode_decode_to_prefill(encode(prefill)).trace_context == CONTEXT
    untraced = GenerateRequest(request_id="r", prompt_token_ids=[1], sampling_params=params)
    assert len(encode(untraced)) < len(encode(generate))  # off: nothing extra on the wire (omitted default)
