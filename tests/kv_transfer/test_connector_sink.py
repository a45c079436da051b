"""The KV connector's sink half without processes or sockets: a decode worker's request walks
WAITING_FOR_BLOCKS -> REQUESTED -> QUEUED_AT_SOURCE / TRANSFERRING -> activated (or ABORTING); TTLs, tear-downs
and every block's way back (the source half: test_connector.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from kv_transfer.connector.sink import KVSink, SinkStatus
from kv_transfer.interface import ReceivedTransfer
from pipeline.protocol.cluster import (
    CancelPrefill,
    GenerateRequest,
    PrefillAccepted,
    PrefillDone,
    PrefillRejected,
    PrefillStarted,
    encode,
)
from tests.kv_transfer.test_connector import GREEDY, WINDOWED, FakeEngine, FakeSender


class FakeReceiver:
    endpoint = "ipc://d-kv"

    def __init__(self) -> None:
        self.expected: dict[str, list[int]] = {}
        self.expected_bytes: dict[str, int | None] = {}
        self.aborted: list[str] = []
        self.results: list[ReceivedTransfer] = []
        self.landed: dict[str, float] = {}  # request id -> when a piece last landed

    layout = FakeSender.layout

    def last_landed(self, request_id):
        return self.landed.get(request_id)

    def expect(self, request_id, block_ids, num_bytes=None):
        self.expected[request_id] = list(block_ids)
        self.expected_bytes[request_id] = num_bytes

    def abort(self, request_id):
        self.aborted.append(request_id)

    def poll(self):
        out, self.results = self.results, []
        return out


class FakeLinks:
    num_bad_frames = 0

    def __init__(self) -> None:
        self.sent: list = []
        self.answers: list = []

    def send(self, endpoint, message):
        self.sent.append((endpoint, message))

    def receive(self):
        out, self.answers = self.answers, []
        return out


def generate(rid="g", kv_source_request_id=None) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=[1, 2, 3, 4, 5], sampling_params=GREEDY,
                           prefill_endpoint="ipc://p", kv_source_request_id=kv_source_request_id)


@pytest.fixture
def sink():
    return KVSink(FakeReceiver(), FakeLinks(), FakeEngine(), "d0", ttl_s=5.0)


def reserve(sink, rid="g", token_ids=(1, 2, 3, 4, 5), num_cached_tokens=4, now=100.0):
    sink.engine.tables[rid] = [10, 11]
    sink.engine.to_reserve = [SimpleNamespace(request_id=rid, token_ids=list(token_ids),
                                              num_cached_tokens=num_cached_tokens)]
    return sink.progress(now)


def done(rid="g", ok=True, token=42, error=None, num_bytes=0):
    payload = encode(PrefillDone(request_id=rid, first_token_id=token, num_draft_computed_tokens=3)) if ok else b""
    return ReceivedTransfer(rid, ok=ok, error=error, payload=payload, num_bytes=num_bytes)


def test_a_remote_prefill_is_reserved_requested_answered_and_activated(sink):
    sink.expect(generate())
    assert sink.get("g").status is SinkStatus.WAITING_FOR_BLOCKS
    assert reserve(sink) == []
    transfer = sink.get("g")
    assert transfer.status is SinkStatus.REQUESTED and transfer.ttl_deadline == 105.0
    assert sink.receiver.expected == {"g": [10, 11]}
    ((endpoint, request),) = sink.links.sent
    assert endpoint == "ipc://p" and request.dst_block_ids == [10, 11] and request.num_cached_tokens == 4
    sink.links.answers.append(PrefillAccepted(request_id="g"))
    sink.progress(200.0)
    assert transfer.status is SinkStatus.QUEUED_AT_SOURCE and transfer.ttl_deadline == math.inf
    sink.expire(10**9)  # queued at the source: load, not a fault
    sink.links.answers.append(PrefillStarted(request_id="g"))
    sink.progress(300.0)
    assert transfer.status is SinkStatus.TRANSFERRING and transfer.ttl_deadline == 305.0
    sink.receiver.results.append(done())
    (event,) = sink.progress(301.0)
    assert event.first_step.new_token_ids == [42] and event.error is None
    assert sink.engine.activated == [("remote", "g", 42)] and sink.get("g") is None


def test_a_ttl_tears_down_and_the_blocks_wait_for_the_receiver(sink):
    sink.expect(generate())
    reserve(sink, now=100.0)
    sink.expire(106.0)
    assert sink.get("g").status is SinkStatus.ABORTING and sink.receiver.aborted == ["g"]
    assert sink.links.sent[-1] == ("ipc://p", CancelPrefill(request_id="g"))
    assert sink.engine.aborted == []  # the receiver may still write
    sink.receiver.results.append(done(ok=False, error="aborted"))
    (event,) = sink.progress(107.0)
    assert event.error == "prefill timed out" and event.retryable
    assert sink.engine.aborted == [("g", False)] and sink.get("g") is None


def test_each_piece_landed_starts_the_ttl_again(sink):
    """A transferring request whose KV keeps landing is not torn down; one silent for the TTL is."""
    sink.expect(generate())
    reserve(sink, now=100.0)
    sink.links.answers.append(PrefillStarted(request_id="g"))
    sink.progress(100.0)
    sink.receiver.landed["g"] = 104.0  # a piece landed 4 s in
    sink.expire(106.0)  # past the start's TTL, inside the piece's
    assert sink.get("g").status is SinkStatus.TRANSFERRING and sink.get("g").ttl_deadline == 109.0
    sink.expire(109.5)  # nothing landed for 5.5 s
    assert sink.get("g").status is SinkStatus.ABORTING and sink.receiver.aborted == ["g"]


def test_a_cancel_reports_nothing_and_a_rejection_does_not_notify_the_source(sink):
    sink.expect(generate())
    reserve(sink)
    assert sink.cancel("g") and sink.owns("g")
    sink.receiver.results.append(done(ok=False))
    assert sink.progress() == [] and sink.engine.aborted == [("g", False)]

    sink.expect(generate("h"))
    reserve(sink, "h")
    num_sent = len(sink.links.sent)
    sink.links.answers.append(PrefillRejected(request_id="h", error="full", retryable=True))
    sink.receiver.results.append(done("h", ok=False))
    (event,) = sink.progress()
    assert event.error == "prefill rejected: full" and event.retryable and len(sink.links.sent) == num_sent


def test_a_request_still_queued_for_blocks_ends_at_once(sink):
    sink.expect(generate())
    assert sink.tear_down("g", "request deadline exceeded", retryable=False)
    assert sink.get("g") is None and sink.engine.aborted == [("g", False)] and not sink.receiver.aborted
    assert not sink.tear_down("unknown", "x", retryable=False)


def test_a_migrated_stream_arrives_and_reports_its_bytes_once(sink):
    sink.expect(generate("m", kv_source_request_id="stream"))
    reserve(sink, "m", token_ids=[1, 2, 3, 4, 5, 6, 7], num_cached_tokens=0)
    (_, request), = sink.links.sent
    assert request.prompt_token_ids == [1, 2, 3, 4, 5, 6, 7] and request.source_request_id == "stream"
    sink.receiver.results.append(done("m", num_bytes=4096))
    (event,) = sink.progress()
    assert event.first_step is None and event.error is None
    assert sink.engine.activated == [("migrated", "m", 3)]
    assert sink.get("m").status is SinkStatus.ARRIVED and not sink.owns("m")
    assert sink.take_migrated_bytes("m") == 4096 and sink.take_migrated_bytes("m") == 0


def test_a_malformed_done_message_fails_the_request(sink):
    sink.expect(generate())
    reserve(sink)
    sink.receiver.results.append(ReceivedTransfer("g", ok=True, payload=b"\x01garbage"))
    (event,) = sink.progress()
    assert event.error.startswith("malformed PrefillDone payload") and sink.engine.aborted == [("g", False)]




def test_the_sink_expects_the_windowed_bytes_and_withholds_blocks_it_will_not_receive(sink):
    sink.receiver.layout = WINDOWED
    for rid, num_cached_tokens in (("g", 0), ("h", 4)):
        sink.expect(GenerateRequest(request_id=rid, prompt_token_ids=list(range(10)), sampling_params=GREEDY,
                                    prefill_endpoint="ipc://p"))
        sink.engine.tables[rid] = [10, 11, 12]
        sink.engine.to_reserve = [SimpleNamespace(request_id=rid, token_ids=list(range(10)),
                                                  num_cached_tokens=num_cached_tokens)]
        sink.progress(100.0)
    # 10 tokens, 3 blocks: the full layer all 3, the sliding ones blocks 1 and 2; with block 0 cached, 2 each
    assert sink.receiver.expected_bytes == {"g": (3 + 2 * 2) * WINDOWED.layer_block_bytes,
                                            "h": 3 * 2 * WINDOWED.layer_block_bytes}
    assert sink.engine.withheld == ["g"]  # "h" misses nothing: block 0 is its own cached prefix
