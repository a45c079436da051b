"""Faults: refused handshakes, corrupt bytes, aborts, dead receivers and malformed frames."""

from __future__ import annotations

import logging
import time

import pytest
import torch
import zmq

from kv_transfer import KVReceiver, KVSender, kv_layout
from pipeline.security import BindError
from pipeline.protocol.transfer import (
    FRAME_ENCODER, RECEIVER_FRAME_DECODER, Blocks, Finish, Hello, HelloReply,
)
from tests.kv_transfer.helpers import TRANSPORT_CASES, random_cache, wait_for


def _free_tcp_endpoint() -> str:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.ROUTER)
        sock.bind("tcp://127.0.0.1:0")
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        sock.close(linger=0)
        return endpoint  # nothing listens there any more
    finally:
        ctx.term()


def test_layout_mismatch_is_refused_on_both_sides(closer, caplog):
    dst = torch.zeros(4, 2, 8, 4, 2, 8)
    receiver = KVReceiver(dst, kv_layout(dst, "model-a"), "tcp://127.0.0.1:0")
    closer(receiver)
    src = random_cache((4, 2, 8, 8, 2, 8), dtype=torch.bfloat16)  # other dtype and page size, other model
    sender = KVSender(src, kv_layout(src, "model-b"))
    closer(sender)
    receiver.expect("r", [0, 1])
    with caplog.at_level(logging.WARNING, logger="kv_transfer"):
        sender.send_blocks("r", receiver.endpoint, [0, 1], [0, 1])
        (status,) = wait_for(None, sender, 0, 1)[1]
    assert not status.ok
    for field in ("model_hash", "dtype", "page_size"):
        assert field in status.error
    assert "head_dim" not in status.error and "handshake refused" in status.error
    assert receiver.stats().num_refused_handshakes == 1
    assert any("refused KV transfer handshake" in r.message and "dtype" in r.message for r in caplog.records)
    assert torch.count_nonzero(dst) == 0
    receiver.abort("r")
    (got,) = wait_for(receiver, None, 1)[0]
    assert got.error == "aborted by receiver"


def test_shm_needs_a_shared_cache_on_the_receiver(closer):
    dst = torch.zeros(2, 2, 4, 2, 1, 4)  # plain memory: the receiver only offers zmq
    receiver = KVReceiver(dst, kv_layout(dst, "m"), "tcp://127.0.0.1:0")
    closer(receiver)
    src = random_cache(dst.shape)
    sender = KVSender(src, kv_layout(src, "m", transport="shm"))
    closer(sender)
    sender.send_blocks("r", receiver.endpoint, [0], [0])
    (status,) = wait_for(None, sender, 0, 1)[1]
    assert not status.ok and "no common transport" in status.error


@pytest.mark.parametrize("case", TRANSPORT_CASES)
def test_corrupt_bytes_fail_the_checksum(make_pair, case):
    sender, receiver, src, dst = make_pair(case)

    def flip_one_bit(request_id, tensor):
        tensor.view(torch.uint8).view(-1)[5] ^= 0x10

    sender.corrupt_hook = flip_one_bit
    receiver.expect("r", [3, 4, 5])
    sender.send_blocks("r", receiver.endpoint, [0, 1, 2], [3, 4, 5])
    sender.finish("r", b"payload")
    (got,), (status,) = wait_for(receiver, sender, 1, 1)
    assert not got.ok and got.error.startswith("checksum mismatch")
    assert not status.ok and "checksum mismatch" in status.error
    assert receiver.stats().num_checksum_mismatches == 1


def test_expected_size_mismatch(make_pair):
    sender, receiver, src, dst = make_pair("zmq-tcp")
    receiver.expect("r", [0, 1, 2], num_bytes=kv_layout(dst, "tiny").kv_bytes(3))
    sender.send_blocks("r", receiver.endpoint, [0, 1], [0, 1])  # P ships only two of the three blocks
    sender.finish("r")
    (got,), (status,) = wait_for(receiver, sender, 1, 1)
    assert not got.ok and got.error.startswith("size mismatch")
    assert not status.ok


@pytest.mark.parametrize("case", TRANSPORT_CASES)
def test_abort_mid_transfer_stops_writes(make_pair, case):
    sender, receiver, src, dst = make_pair(case)
    receiver.expect("r", [0, 1, 2, 3])
    sender.send_blocks("r", receiver.endpoint, [4, 5], [0, 1])
    wait_until = time.monotonic() + 5
    while not torch.equal(dst[:, :, [0, 1]], src[:, :, [4, 5]]):  # the first chunk landed
        assert time.monotonic() < wait_until
        time.sleep(0.002)
    receiver.abort("r")
    (got,) = wait_for(receiver, None, 1)[0]
    assert not got.ok and got.error == "aborted by receiver"
    # D reuses the blocks for another request; P, not yet aware, keeps pushing the old one.
    snapshot = dst.clone()
    sender.send_blocks("r", receiver.endpoint, [6, 7], [2, 3])
    sender.finish("r", b"late")
    (status,) = wait_for(None, sender, 0, 1)[1]
    assert not status.ok and "aborted by receiver" in status.error
    time.sleep(0.1)
    assert torch.equal(dst, snapshot)
    assert receiver.poll() == [] and sender.poll() == []  # nothing reported twice


def _receiver_and_raw_sender(closer, raw_socket) -> tuple[torch.Tensor, KVReceiver, zmq.Socket]:
    """A zmq receiver over a zeroed cache and a bare DEALER that completed the handshake with it: a sender
    that sends whatever the test wants."""
    dst = torch.zeros(2, 2, 4, 2, 1, 4)
    layout = kv_layout(dst, "m", transport="zmq")
    receiver = KVReceiver(dst, layout, "tcp://127.0.0.1:0")
    closer(receiver)
    raw = raw_socket(zmq.DEALER)
    raw.connect(receiver.endpoint)
    raw.send(FRAME_ENCODER.encode(Hello(layout=layout, host_id="elsewhere")))
    assert RECEIVER_FRAME_DECODER.decode(raw.recv()).ok
    return dst, receiver, raw


def test_late_bytes_for_an_aborted_request_are_discarded(closer, raw_socket):
    """Even a sender that ignores Revoke cannot write into an aborted reservation."""
    dst, receiver, raw = _receiver_and_raw_sender(closer, raw_socket)
    receiver.expect("r", [1])
    receiver.abort("r")
    (got,) = wait_for(receiver, None, 1)[0]
    assert got.error == "aborted by receiver"
    piece = torch.ones(2, 2, 1, 2, 1, 4)
    header = Blocks(request_id="r", layer_start=0, layer_stop=2, dst_block_ids=[1], num_bytes=piece.numel() * 4)
    raw.send_multipart([FRAME_ENCODER.encode(header), piece.numpy()])
    raw.send(FRAME_ENCODER.encode(Finish(request_id="r", num_bytes=piece.numel() * 4, checksum=0)))
    replies = [RECEIVER_FRAME_DECODER.decode(raw.recv()) for _ in range(2)]
    assert [type(r).__name__ for r in replies] == ["Revoke", "FinishAck"] and not replies[1].ok
    assert torch.count_nonzero(dst) == 0
    assert receiver.stats().num_late_dropped == 2 and receiver.poll() == []


def test_unknown_request_is_reported_once(make_pair):
    sender, receiver, src, dst = make_pair("zmq-tcp")
    sender.send_blocks("ghost", receiver.endpoint, [0], [0])
    sender.finish("ghost")
    (got,), (status,) = wait_for(receiver, sender, 1, 1)
    assert not got.ok and got.error.startswith("unknown request")
    assert not status.ok and "unknown request" in status.error
    assert torch.count_nonzero(dst) == 0


def test_a_flood_of_frames_for_unknown_requests_logs_a_few_lines(closer, raw_socket, caplog):
    """Each is still reported and answered, but logged one by one only at first (2,000 frames of an audit made
    2,000 warnings)."""
    dst, receiver, raw = _receiver_and_raw_sender(closer, raw_socket)
    with caplog.at_level("WARNING", logger="kv_transfer.receiver"):
        for i in range(30):
            raw.send(FRAME_ENCODER.encode(Finish(request_id=f"flood-{i}", num_bytes=0, checksum=0)))
        replies = [RECEIVER_FRAME_DECODER.decode(raw.recv()) for _ in range(30)]
    assert all(type(r).__name__ == "FinishAck" and not r.ok for r in replies)
    assert sum("unknown request" in r.getMessage() for r in caplog.records) == 10
    assert torch.count_nonzero(dst) == 0


def test_sender_abort_is_reported_on_both_sides(make_pair):
    sender, receiver, src, dst = make_pair("shm")
    receiver.expect("r", [0, 1])
    sender.send_blocks("r", receiver.endpoint, [0], [0])
    wait_until = time.monotonic() + 5
    while receiver.stats().transports.get("shm") is None:
        assert time.monotonic() < wait_until
        time.sleep(0.002)
    sender.abort("r")
    (got,), (status,) = wait_for(receiver, sender, 1, 1)
    assert got.error == "aborted by sender" and status.error == "aborted by sender"


def test_no_receiver_fails_within_timeout(closer):
    src = random_cache()
    sender = KVSender(src, kv_layout(src, "m"), timeout_s=0.3)
    closer(sender)
    start = time.monotonic()
    sender.send_blocks("r", _free_tcp_endpoint(), [0], [0])
    sender.finish("r")
    (status,) = wait_for(None, sender, 0, 1, timeout=3)[1]
    assert not status.ok and "no handshake reply" in status.error
    assert time.monotonic() - start < 1.5
    assert sender.stats().num_timeouts == 1


def test_receiver_that_stops_answering_fails_within_timeout(closer, raw_socket):
    src = random_cache()
    layout = kv_layout(src, "m", transport="zmq")
    router = raw_socket(zmq.ROUTER)  # a receiver that handshakes, then hangs forever
    router.bind("tcp://127.0.0.1:0")
    sender = KVSender(src, layout, timeout_s=0.3)
    closer(sender)
    sender.send_blocks("r", router.getsockopt_string(zmq.LAST_ENDPOINT), [0, 1], [0, 1])
    identity, _hello = router.recv_multipart()
    router.send_multipart([identity, b"\x00garbage"])  # a malformed reply is dropped and counted too
    router.send_multipart([identity, FRAME_ENCODER.encode(HelloReply(ok=True, layout=layout, host_id="x",
                                                                      transport="zmq"))])
    start = time.monotonic()
    sender.finish("r")
    (status,) = wait_for(None, sender, 0, 1, timeout=3)[1]
    assert not status.ok and "made no progress" in status.error
    assert time.monotonic() - start < 1.5
    assert sender.stats().num_bad_frames == 1


def test_receiver_closed_mid_request_fails_the_sender(make_pair):
    sender, receiver, src, dst = make_pair("zmq-tcp", timeout_s=0.5)
    receiver.expect("r", [0, 1])
    sender.send_blocks("r", receiver.endpoint, [0], [0])
    time.sleep(0.1)
    receiver.close()
    sender.finish("r")
    (status,) = wait_for(None, sender, 0, 1, timeout=3)[1]
    assert not status.ok


def test_malformed_frames_are_dropped_and_counted(make_pair, raw_socket, caplog):
    sender, receiver, src, dst = make_pair("zmq-tcp")
    raw = raw_socket(zmq.DEALER)
    raw.connect(receiver.endpoint)
    layout = kv_layout(dst, "tiny", transport="zmq")
    with caplog.at_level(logging.WARNING, logger="kv_transfer"):
        raw.send(b"\xc1 not msgpack")
        raw.send(FRAME_ENCODER.encode(["blocks", "r", "not-an-int"]))  # right tag, wrong types
        raw.send_multipart([FRAME_ENCODER.encode(Hello(layout=layout, host_id="x")), b"extra frame"])
        raw.send(FRAME_ENCODER.encode(Blocks(request_id="r", layer_start=0, layer_stop=1, dst_block_ids=[0],
                                             num_bytes=8)))  # a Blocks header without its data frame
        deadline = time.monotonic() + 5
        while receiver.stats().num_bad_frames < 4:
            assert time.monotonic() < deadline
            time.sleep(0.005)
    assert any("dropped a bad frame" in r.message for r in caplog.records)
    # The service keeps working.
    receiver.expect("r", [0])
    sender.send_blocks("r", receiver.endpoint, [2], [0])
    sender.finish("r")
    (got,), (status,) = wait_for(receiver, sender, 1, 1)
    assert got.ok and status.ok and torch.equal(dst[:, :, 0], src[:, :, 2])
    assert receiver.stats().num_bad_frames == 4


def test_bad_piece_header_fails_only_that_request(closer, raw_socket):
    dst, receiver, raw = _receiver_and_raw_sender(closer, raw_socket)
    receiver.expect("r", [1])
    piece = torch.ones(2, 2, 1, 2, 1, 4)
    header = Blocks(request_id="r", layer_start=0, layer_stop=2, dst_block_ids=[2], num_bytes=piece.numel() * 4)
    raw.send_multipart([FRAME_ENCODER.encode(header), piece.numpy()])  # block 2 is not reserved
    (got,) = wait_for(receiver, None, 1)[0]
    assert not got.ok and "reserved" in got.error
    assert torch.count_nonzero(dst) == 0


def test_bad_endpoint_fails_the_request_not_the_sender(closer):
    src = random_cache()
    sender = KVSender(src, kv_layout(src, "m"), timeout_s=0.3)
    closer(sender)
    sender.send_blocks("r", "not-an-endpoint", [0], [0])
    (status,) = wait_for(None, sender, 0, 1)[1]
    assert not status.ok and "cannot connect" in status.error
    with pytest.raises(ValueError, match="differ in length"):
        sender.send_blocks("r2", "tcp://127.0.0.1:1", [0, 1], [0])
    with pytest.raises(ValueError, match="out of range"):
        sender.send_blocks("r2", "tcp://127.0.0.1:1", [10_000], [0])
    with pytest.raises(ValueError, match="finish needs an open request"):
        sender.finish("never-started")


def test_bind_failure_raises_and_leaks_nothing(closer):
    dst = torch.zeros(1, 2, 2, 1, 1, 2)
    first = KVReceiver(dst, kv_layout(dst, "m"), "tcp://127.0.0.1:0")
    closer(first)
    with pytest.raises(BindError, match=f"cannot listen on {first.endpoint} .*the port must be free"):
        KVReceiver(dst, kv_layout(dst, "m"), first.endpoint)  # address in use
