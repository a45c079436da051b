"""pipeline.protocol.cluster: every message round-trips; bad frames raise DecodeError, never crash."""

from __future__ import annotations

import msgspec
import pytest

from pipeline.config import PipelineRole
from pipeline.protocol.cluster import (
    BUILTIN_MODEL_NAME,
    CancelPrefill,
    CancelRequest,
    FinishCode,
    GenerateRequest,
    Heartbeat,
    PrefillDone,
    PrefillAccepted,
    PrefillRejected,
    PrefillStarted,
    PrefillRequest,
    RegisterAck,
    RegisterWorker,
    TokenBatch,
    TokenDelta,
    WorkerLoad,
    WorkerRole,
    decode_decode_to_prefill,
    decode_prefill_done,
    decode_prefill_to_decode,
    decode_router_to_worker,
    decode_worker_to_router,
    encode,
    encode_prefill_done,
    served_model_name,
)
from pipeline.protocol.requests import FinishReason, SamplingParams, TokenLogprob

PARAMS = SamplingParams(max_tokens=7, temperature=0.0, stop=["\n"], logprobs=2, logit_bias={5: -1.0})

WORKER_TO_ROUTER = [
    RegisterWorker(worker_id="p0", role=WorkerRole.PREFILL_ONLY, model_name="m", max_length=4096, page_size=16,
                   num_total_blocks=100, prefill_endpoint="tcp://10.0.0.6:4567", pid=42),
    Heartbeat(worker_id="d0", load=WorkerLoad(num_queued_prefill_tokens=5, num_running=2, num_waiting=1,
                                              num_free_blocks=90, num_used_blocks=10, num_total_blocks=100,
                                              transfer_bytes=1 << 40, transfer_seconds=1.5, num_bad_frames=3)),
    TokenBatch(outputs=[
        TokenDelta(request_id="a", token_ids=[1, 2],
                   logprobs=[[TokenLogprob(1, -0.1), TokenLogprob(9, -2.0)], [TokenLogprob(2, -0.2)]]),
        TokenDelta(request_id="b", token_ids=[3], finish_reason=FinishCode.STOP, stop_token_id=3,
                   num_prompt_tokens=11, num_cached_tokens=8),
        TokenDelta(request_id="c", finish_reason=FinishCode.ERROR, error="no blocks", retryable=True),
    ]),
]
ROUTER_TO_WORKER = [
    GenerateRequest(request_id="a", prompt_token_ids=[1, 2, 3], sampling_params=PARAMS, prefill_worker_id="p0",
                    prefill_endpoint="ipc:///tmp/t-p0-prefill", deadline_s=30.0),
    GenerateRequest(request_id="b", prompt_token_ids=[4], sampling_params=SamplingParams()),
    CancelRequest(request_id="a"),
    RegisterAck(accepted=True, heartbeat_interval_s=0.25),
    RegisterAck(accepted=False, error="model mismatch"),
]
DECODE_TO_PREFILL = [
    PrefillRequest(request_id="a", prompt_token_ids=list(range(40)), sampling_params=PARAMS, dst_block_ids=[7, 3, 9],
                   num_cached_tokens=16, transfer_endpoint="tcp://10.0.0.7:5000", decode_worker_id="d0", ttl_s=20.0),
    CancelPrefill(request_id="a"),
]


@pytest.mark.parametrize("msg", WORKER_TO_ROUTER, ids=lambda m: type(m).__name__)
def test_worker_to_router_round_trip(msg):
    assert decode_worker_to_router(encode(msg)) == msg


@pytest.mark.parametrize("msg", ROUTER_TO_WORKER, ids=lambda m: type(m).__name__)
def test_router_to_worker_round_trip(msg):
    decoded = decode_router_to_worker(encode(msg))
    assert decoded == msg and type(decoded) is type(msg)


@pytest.mark.parametrize("msg", DECODE_TO_PREFILL, ids=lambda m: type(m).__name__)
def test_decode_to_prefill_round_trip(msg):
    assert decode_decode_to_prefill(encode(msg)) == msg


def test_prefill_to_decode_and_prefill_done_round_trip():
    for answer in (PrefillRejected(request_id="a", error="queue full", retryable=True),
                   PrefillAccepted(request_id="a"), PrefillStarted(request_id="a")):
        decoded = decode_prefill_to_decode(encode(answer))
        assert decoded == answer and type(decoded) is type(answer)
    done = PrefillDone(request_id="a", first_token_id=17, first_logprobs=[TokenLogprob(17, -0.3), TokenLogprob(4, -1.9)],
                       num_prompt_tokens=40, num_computed_tokens=24, prefill_worker_id="p0")
    payload = encode_prefill_done(done)
    assert isinstance(payload, bytes) and decode_prefill_done(payload) == done
    assert decode_prefill_done(memoryview(payload)) == done


def test_hot_path_messages_are_compact_arrays():
    frame = encode(CancelRequest(request_id="abc"))
    assert msgspec.msgpack.decode(frame) == ["CancelRequest", "abc", None]  # index None: every choice
    heartbeat = msgspec.msgpack.decode(encode(WORKER_TO_ROUTER[1]))
    assert heartbeat[0] == "Heartbeat" and isinstance(heartbeat[2], list)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xff\xfe garbage",
        msgspec.msgpack.encode({"type": "Heartbeat"}),
        msgspec.msgpack.encode(["NoSuchMessage", 1]),
        msgspec.msgpack.encode(["Heartbeat", "w0"]),  # missing load
        msgspec.msgpack.encode(["Heartbeat", 5, []]),  # worker_id of the wrong type
        msgspec.msgpack.encode(["TokenBatch", [["a", [1], None, 99]]]),  # unknown finish code
        encode(CancelRequest(request_id="a")),  # valid, but for the other direction
    ],
)
def test_malformed_worker_frames_raise_decode_error(frame):
    with pytest.raises(msgspec.DecodeError):
        decode_worker_to_router(frame)


def test_invalid_sampling_params_on_the_wire_are_a_validation_error():
    frame = msgspec.msgpack.encode(["GenerateRequest", "a", [1], {"temperature": -1.0}])
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        decode_router_to_worker(frame)
    with pytest.raises(msgspec.DecodeError):
        decode_decode_to_prefill(encode(GenerateRequest(request_id="a", prompt_token_ids=[1], sampling_params=PARAMS)))
    with pytest.raises(msgspec.DecodeError):
        decode_prefill_done(b"\x93\x01")


def test_role_and_finish_codes_map_to_the_string_enums():
    for role in PipelineRole:
        assert WorkerRole.from_pipeline_role(role).to_pipeline_role() is role
    assert WorkerRole.from_pipeline_role("DecodeOnly") is WorkerRole.DECODE_ONLY
    assert {code.to_finish_reason() for code in FinishCode} == set(FinishReason)


def test_served_model_name():
    assert served_model_name(None) == BUILTIN_MODEL_NAME
    assert served_model_name("/models/Qwen3-0.6B/") == "Qwen3-0.6B"
