"""``trace_context`` on the wire: GenerateRequest, StartPrefill and PrefillRequest carry it (the decode
worker's sink copies it from the one to the other); frames from processes that predate it decode with
None, and such processes read new frames (the trailing field is ignored)."""

from __future__ import annotations

import msgspec

from pipeline.protocol.cluster import (
    DEFAULT_DEADLINE_S,
    GenerateRequest,
    decode_router_to_worker,
    encode,
)
from pipeline.protocol.requests import SamplingParams
from tests.router.wire_roundtrip import round_trip_work_starting_messages

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
    messages = round_trip_work_starting_messages(trace_context=CONTEXT)
    assert [message.trace_context for message in messages] == [CONTEXT] * 3
    params = SamplingParams(max_tokens=3)
    traced = GenerateRequest(request_id="r", prompt_token_ids=[1], sampling_params=params, trace_context=CONTEXT)
    untraced = GenerateRequest(request_id="r", prompt_token_ids=[1], sampling_params=params)
    assert len(encode(untraced)) < len(encode(traced))  # off: nothing extra on the wire (omitted default)
