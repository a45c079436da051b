"""The KV connector's source half without processes or sockets: a request walks UNCLAIMED/QUEUED -> SHIPPING ->
FINISHING -> reaped (or DROPPING); deadlines, drops and every block's way back. The fakes here serve the sink
half's tests too (test_connector_sink.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from kv_transfer.connector.source import KVSource, SourceStatus
from kv_transfer.interface import SendStatus
from pipeline.protocol import SamplingParams
from pipeline.protocol.transfer import KVLayout
from pipeline.protocol.cluster import (
    CancelPrefill,
    PrefillRejected,
    PrefillRequest,
    PrefillStarted,
    StartPrefill,
)

PAGE = 4
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


class FakeEngine:
    page_size = PAGE

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}
        self.aborted: list[tuple[str, bool]] = []
        self.to_reserve: list = []
        self.activated: list = []
        self.withheld: list[str] = []

    def withhold_from_prefix_cache(self, request_id):
        self.withheld.append(request_id)

    def block_table(self, request_id):
        return self.tables[request_id]

    def abort_request(self, request_id, keep_blocks=False):
        self.aborted.append((request_id, keep_blocks))
        return True

    def reserve_remote(self):
        reserved, self.to_reserve = self.to_reserve, []
        return reserved

    def activate_remote(self, request_id, first_token_id, first_logprobs, prompt_logprobs=None,
                        num_prefill_computed_tokens=None):
        self.activated.append(("remote", request_id, first_token_id))
        return SimpleNamespace(request_id=request_id, new_token_ids=[first_token_id])

    def activate_migrated(self, request_id, num_draft_computed_tokens=None):
        self.activated.append(("migrated", request_id, num_draft_computed_tokens))


class FakeSender:
    def __init__(self) -> None:
        self.sent: list[tuple[str, list[int], list[int]]] = []
        self.layers: list[slice | None] = []
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self.results: list[SendStatus] = []

    layout = KVLayout(model_hash="m", dtype="float32", page_size=PAGE, num_layers=2, num_kv_heads=1, head_dim=2)

    def send_blocks(self, request_id, endpoint, src, dst, layers=None):
        self.sent.append((request_id, list(src), list(dst)))
        self.layers.append(layers)

    def finish(self, request_id, payload):
        self.finished.append(request_id)

    def abort(self, request_id):
        self.aborted.append(request_id)

    def poll(self):
        out, self.results = self.results, []
        return out


class FakeSocket:
    num_bad_frames = 0

    def __init__(self) -> None:
        self.sent: list = []
        self.incoming: list = []

    def send(self, message, to=None):
        self.sent.append((message, to))

    def receive_ready(self):
        out, self.incoming = self.incoming, []
        return [(message, identity, []) for message, identity in out]

    def kinds(self) -> list[str]:
        return [type(message).__name__ for message, _ in self.sent]


def prefill_request(rid="r", num_cached_tokens=0, num_blocks=3, source_request_id=None) -> PrefillRequest:
    return PrefillRequest(request_id=rid, prompt_token_ids=list(range(10)), sampling_params=GREEDY,
                          dst_block_ids=list(range(100, 100 + num_blocks)), num_cached_tokens=num_cached_tokens,
                          transfer_endpoint="ipc://d", decode_worker_id="d0", ttl_s=5.0,
                          source_request_id=source_request_id)


@pytest.fixture
def source():
    engine, sender, socket = FakeEngine(), FakeSender(), FakeSocket()
    engine.tables["r"] = [7, 8, 9]
    return KVSource(sender, socket, "ipc://p", engine)


def test_a_request_ships_as_chunks_complete_then_finishes_and_its_blocks_come_back(source):
    source.accept(b"d0", prefill_request(num_cached_tokens=4))  # D holds the first block already
    transfer = source.get("r")
    assert transfer.status is SourceStatus.QUEUED and transfer.deadline == math.inf
    assert source.socket.kinds() == ["PrefillAccepted"]
    source.on_kv_written([("r", 8)])  # the first chunk: blocks 0 and 1 complete, block 0 skipped
    assert transfer.status is SourceStatus.SHIPPING and transfer.deadline < math.inf
    assert source.socket.kinds() == ["PrefillAccepted", "PrefillStarted"]
    assert source.sender.sent == [("r", [8], [101])]
    source.finish("r", b"done", upto_block=3)  # the last, partial block, then the done message
    assert transfer.status is SourceStatus.FINISHING
    assert source.sender.sent[-1] == ("r", [9], [102]) and source.sender.finished == ["r"]
    source.sender.results.append(SendStatus("r", ok=True))
    ((reaped, status),) = source.reap()
    assert reaped is transfer and status.ok and "r" not in source
    assert source.engine.aborted == [("r", False)]  # the blocks are freed only now


def test_an_unclaimed_request_ends_after_its_hold_and_a_claim_before_it_ships(source):
    source.hold("r", hold_s=2.0, early=StartPrefill(request_id="r", prompt_token_ids=[1], sampling_params=GREEDY))
    source.expire(now=source.get("r").deadline - 0.1)
    assert source.get("r").status is SourceStatus.UNCLAIMED
    source.claim("r", b"d0", prefill_request())
    assert source.get("r").status is SourceStatus.QUEUED and source.get("r").early is None
    source.expire(now=math.inf - 1)  # no TTL while queued
    assert "r" in source
    with pytest.raises(ValueError, match="QUEUED -> QUEUED"):
        source.claim("r", b"d0", prefill_request())

    source.hold("late", hold_s=2.0)
    source.expire(now=source.get("late").deadline + 0.1)
    assert "late" not in source and source.engine.aborted == [("late", False)] and not source.sender.aborted


def test_a_drop_waits_for_the_sender_when_it_has_seen_the_request(source):
    source.accept(b"d0", prefill_request())
    source.drop("r", "nothing sent yet")  # ends at once
    assert "r" not in source and source.engine.aborted == [("r", False)]

    source.engine.aborted.clear()
    source.accept(b"d0", prefill_request())
    source.on_kv_written([("r", 4)])
    source.socket.incoming.append((CancelPrefill(request_id="r"), b"d0"))
    assert source.receive() == []
    assert source.get("r").status is SourceStatus.DROPPING
    assert source.engine.aborted == [("r", True)] and source.sender.aborted == ["r"]  # held until the sender lets go
    source.sender.results.append(SendStatus("r", ok=False, error="aborted"))
    source.reap()
    assert "r" not in source and source.engine.aborted == [("r", True), ("r", False)]


def test_a_cancel_withdraws_its_sinks_ask_read_in_the_same_batch(source):
    """The router started the prompt early; the decode worker asked for it, then cancelled (its client left):
    both arrive in one batch. The early prompt is dropped and the ask is not handed on to start it again."""
    source.hold("r", hold_s=2.0, early=StartPrefill(request_id="r", prompt_token_ids=[1], sampling_params=GREEDY))
    source.socket.incoming += [(prefill_request(), b"d0"), (prefill_request("other"), b"d0"),
                               (CancelPrefill(request_id="r"), b"d0"), (prefill_request("r"), b"d1")]
    asks = source.receive()
    assert [(sink, ask.request_id) for sink, ask in asks] == [(b"d0", "other"), (b"d1", "r")]
    assert "r" not in source and source.engine.aborted == [("r", False)]


def test_a_ttl_past_its_start_drops_and_fail_all_rejects_what_never_shipped(source):
    source.accept(b"d0", prefill_request())
    source.start("r")
    source.expire(now=source.get("r").deadline + 1)
    assert "r" not in source  # nothing had reached the sender

    source.engine.tables["q"] = [1, 2, 3]
    source.accept(b"d1", prefill_request("q"))
    source.fail_all("shutting down")
    assert source.socket.sent[-1] == (PrefillRejected(request_id="q", error="shutting down", retryable=True), b"d1")
    assert not source.has_work()


def test_each_chunk_computed_starts_the_ttl_again(source, monkeypatch):
    """A long prompt beside others gets a chunk now and then: slow, not stuck. The TTL runs from its last chunk."""
    import kv_transfer.connector.source as source_module

    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(source_module.time, "monotonic", lambda: clock.now)
    source.accept(b"d0", prefill_request())
    source.on_kv_written([("r", 4)])  # the first chunk: started, TTL 5 s
    assert source.get("r").deadline == 105.0
    clock.now = 104.0
    source.on_kv_written([("r", 8)])  # the next chunk, 4 s later
    source.expire(now=107.0)  # past the first chunk's TTL, inside the second's
    assert source.get("r").status is SourceStatus.SHIPPING and source.get("r").deadline == 109.0
    source.expire(now=109.5)  # no chunk for 5.5 s
    assert source.get("r").status is SourceStatus.DROPPING


def test_a_handed_off_stream_is_claimed_under_the_targets_id_and_finishes_with_nothing_to_ship(source):
    source.engine.tables["stream"] = [5]
    source.hold("stream")
    # the target holds the whole stream's KV already (its prefix cache)
    source.claim("stream", b"d2", prefill_request("t-1", num_cached_tokens=4, num_blocks=1,
                                                  source_request_id="stream"), acknowledge=False)
    source.start("stream", ttl_s=math.inf)
    assert source.socket.sent == [(PrefillStarted(request_id="t-1"), b"d2")]
    source.finish("stream", b"done", upto_block=1)
    assert source.sender.sent == [("t-1", [], [])] and source.sender.finished == ["t-1"]  # opened for the done message
    source.socket.incoming.append((CancelPrefill(request_id="t-1"), b"d2"))
    source.receive()
    assert source.get("stream").status is SourceStatus.DROPPING and source.sender.aborted == ["t-1"]
    source.sender.results.append(SendStatus("t-1", ok=False))
    assert [t.request_id for t, _ in source.reap()] == ["stream"]


def test_a_declined_offer_is_released_untouched(source):
    source.hold("s")
    source.release("s")
    assert "s" not in source and not source.engine.aborted
    source.accept(b"d0", prefill_request())
    with pytest.raises(ValueError):
        source.release("r")


# ---------------------------------------------------------------- sliding-window layers
WINDOWED = KVLayout(model_hash="m", dtype="float32", page_size=PAGE, num_layers=3, num_kv_heads=1, head_dim=2,
                    layer_windows=(4, 0, 4))  # sliding, full, sliding


def test_a_sliding_layer_ships_only_the_blocks_in_its_window(source):
    """A 10-token prompt, window 4: queries from token 10 on see keys from 7 on (block 1), so block 0 goes for
    the full layer only; every other block for every layer, as chunks complete."""
    source.sender.layout = WINDOWED
    source.accept(b"d", prefill_request(num_blocks=3))
    source.on_kv_written([("r", 4)])
    source.on_kv_written([("r", 8)])
    source.finish("r", b"done", upto_block=3)
    assert [(src, layers) for _, src, _, layers in zip(*zip(*source.sender.sent), source.sender.layers)] == [
        ([7], slice(1, 2)), ([8], slice(0, 3)), ([9], slice(0, 3))]


def test_a_plan_that_skips_every_layer_of_the_first_blocks_opens_the_sender_only_when_it_sends(source):
    source.sender.layout = KVLayout(model_hash="m", dtype="float32", page_size=PAGE, num_layers=2, num_kv_heads=1,
                                    head_dim=2, layer_windows=(4, 4))
    source.accept(b"d", prefill_request(num_blocks=3))
    source.on_kv_written([("r", 4)])  # block 0: outside every window, nothing sent
    transfer = source.get("r")
    assert source.sender.sent == [] and transfer.num_sent_blocks == 1 and not transfer.is_known_to_sender
    source.drop("r", "cancelled")  # the sender never saw it: gone at once
    assert source.get("r") is None and source.engine.aborted == [("r", False)]
