"""The three messages that start work on a worker (GenerateRequest, StartPrefill, PrefillRequest), built with
the same extra fields and read back through the receivers' decoders: a trailing wire field's round trip."""

from __future__ import annotations

from pipeline.protocol.cluster import (
    GenerateRequest,
    PrefillRequest,
    StartPrefill,
    decode_decode_to_prefill,
    decode_router_to_worker,
    encode,
)
from pipeline.protocol.requests import SamplingParams


def round_trip_work_starting_messages(**fields) -> list:
    """[GenerateRequest, StartPrefill, PrefillRequest] with ``fields`` set, each encoded and decoded as its
    receiver decodes it."""
    params = SamplingParams(max_tokens=3)
    generate = GenerateRequest(request_id="r", prompt_token_ids=[1], sampling_params=params, **fields)
    start = StartPrefill(request_id="r", prompt_token_ids=[1], sampling_params=params, **fields)
    prefill = PrefillRequest(request_id="r", prompt_token_ids=[1], sampling_params=params, dst_block_ids=[0],
                             num_cached_tokens=0, transfer_endpoint="ipc:///x", decode_worker_id="d", ttl_s=1.0,
                             **fields)
    return [decode_router_to_worker(encode(generate)), decode_router_to_worker(encode(start)),
            decode_decode_to_prefill(encode(prefill))]
