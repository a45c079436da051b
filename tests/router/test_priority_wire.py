"""``priority`` on the wire: carried by GenerateRequest, StartPrefill and PrefillRequest; frames of
processes that predate the field still decode (priority 0), and such processes read new frames."""

from __future__ import annotations

import msgspec
import pytest

from pipeline.protocol.cluster import (
    DEFAULT_DEADLINE_S,
    GenerateRequest,
    decode_router_to_worker,
    encode,
)
from pipeline.protocol.requests import SamplingParams
from tests.router.wire_roundtrip import round_trip_work_starting_messages

class OldGenerateRequest(msgspec.Struct, tag="GenerateRequest", array_like=True, omit_defaults=True, gc=False,
                         kw_only=True):
    """GenerateRequest as sent before ``priority``: the same tag and fields, in the same order."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prefill_worker_id: str | None = None
    prefill_endpoint: str | None = None
    deadline_s: float = DEFAULT_DEADLINE_S
    resume_token_ids: list[int] = msgspec.field(default_factory=list)
    kv_source_request_id: str | None = None


def test_a_frame_without_priority_decodes_with_priority_0():
    old = OldGenerateRequest(request_id="r1", prompt_token_ids=[1, 2], sampling_params=SamplingParams(max_tokens=3),
                         resume_token_ids=[4], kv_source_request_id="src")
    decoded = decode_router_to_worker(encode(old))
    assert isinstance(decoded, GenerateRequest)
    assert decoded.priority == 0 and decoded.resume_token_ids == [4] and decoded.kv_source_request_id == "src"


def test_a_process_that_predates_priority_decodes_a_new_frame():
    params = SamplingParams(max_tokens=3)
    frame = encode(GenerateRequest(request_id="r1", prompt_token_ids=[1, 2], sampling_params=params,
                                   kv_source_request_id="src", priority=4))
    old = msgspec.msgpack.decode(frame, type=OldGenerateRequest)  # the trailing field is ignored
    assert old.request_id == "r1" and old.kv_source_request_id == "src"


@pytest.mark.parametrize("priority", [-5, 7])
def test_priority_round_trips(priority):
    assert [message.priority for message in round_trip_work_starting_messages(priority=priority)] == [priority] * 3
