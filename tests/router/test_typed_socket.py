"""pipeline.protocol.typed_socket: real ZMQ sockets over ipc; bad frames are counted, logged and dropped,
and the next good message still arrives."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import zmq
import zmq.asyncio

from pipeline.protocol.cluster import (
    CancelPrefill,
    PrefillAccepted,
    PrefillRequest,
    decode_decode_to_prefill,
    decode_prefill_to_decode,
    encode,
)
from pipeline.protocol.requests import SamplingParams
from pipeline.protocol.transfer import RECEIVER_FRAME_DECODER, SENDER_FRAME_DECODER, Blocks, Grant
from pipeline.protocol.typed_socket import TypedSocket, open_socket

REQUEST = PrefillRequest(request_id="a", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=2),
                         dst_block_ids=[4], num_cached_tokens=0, transfer_endpoint="ipc:///tmp/kv",
                         decode_worker_id="d0", ttl_s=5.0)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def pair(ctx, tmp_path):
    """A bound typed ROUTER (counting bad frames into ``hook``) and a raw DEALER connected to it."""
    hook = []
    server = TypedSocket(ctx, zmq.ROUTER, decode_decode_to_prefill, "test socket",
                         on_bad_frame=lambda: hook.append(1))
    endpoint = server.bind(f"ipc://{tmp_path}/server")
    client = open_socket(ctx, zmq.DEALER, identity="d0")
    client.connect(endpoint)
    yield server, client, hook
    server.close()
    client.close()


def receive(sock: TypedSocket, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = sock.receive()
        if got is not None:
            return got
        sock.socket.poll(50)
    raise AssertionError("no message arrived")


def test_good_message_round_trips_and_the_reply_reaches_its_sender(ctx, pair):
    server, client, hook = pair
    client.send(encode(REQUEST))
    got = receive(server)
    assert got.message == REQUEST and got.sender == b"d0" and got.data == []
    server.send(PrefillAccepted(request_id="a"), to=got.sender)
    assert client.poll(5000)
    assert decode_prefill_to_decode(client.recv()) == PrefillAccepted(request_id="a")
    assert server.num_bad_frames == 0 and hook == []


def test_garbage_is_counted_logged_and_dropped_and_the_next_message_arrives(pair, caplog):
    server, client, hook = pair
    with caplog.at_level(logging.WARNING):
        client.send(b"\xc1 not msgpack")
        client.send(encode(PrefillAccepted(request_id="x")))  # valid msgpack, not this socket's union
        client.send_multipart([encode(REQUEST), b"a frame too many"])
        client.send(b"\x91\xa2\xff\xfe")  # an array holding a string that is not UTF-8 (msgspec: UnicodeDecodeError)
        client.send(encode(CancelPrefill(request_id="a")))
        got = receive(server)
    assert got.message == CancelPrefill(request_id="a")
    assert server.num_bad_frames == 4 and len(hook) == 4
    dropped = [r.getMessage() for r in caplog.records if "dropped a bad frame" in r.getMessage()]
    assert len(dropped) == 4 and all(m.startswith("test socket: ") and "b'd0'" in m for m in dropped)
    assert "got 2" in dropped[2] and "utf-8" in dropped[3].lower()  # msgspec 0.23 says "UTF-8"


def test_bad_frames_are_logged_rate_limited(pair, caplog):
    server, client, _ = pair
    with caplog.at_level(logging.WARNING):
        for _ in range(15):
            client.send(b"\xc1")
        client.send(encode(CancelPrefill(request_id="a")))
        receive(server)
    assert server.num_bad_frames == 15
    assert sum("dropped a bad frame" in r.getMessage() for r in caplog.records) == 10


def test_owner_checks_count_as_bad_frames(pair):
    server, _, hook = pair
    server.count_bad_frame("w1", "heartbeat for another worker")
    assert server.num_bad_frames == 1 and hook == [1]


def test_receive_ready_reads_what_waits_up_to_a_limit(pair):
    server, client, _ = pair
    for i in range(5):
        client.send(encode(CancelPrefill(request_id=str(i))))
    deadline = time.monotonic() + 5
    while server.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.1)  # all five queued
    first = [got.message.request_id for got in server.receive_ready(limit=2)]
    rest = [got.message.request_id for got in server.receive_ready()]
    assert first == ["0", "1"] and rest == ["2", "3", "4"]
    assert server.receive() is None


def test_raw_data_frames_travel_zero_copy_beside_the_header(ctx, tmp_path):
    receiver = TypedSocket(ctx, zmq.ROUTER, SENDER_FRAME_DECODER.decode, "kv", max_data_frames=1, zero_copy=True,
                           rcvhwm=64)
    sender = TypedSocket(ctx, zmq.DEALER, RECEIVER_FRAME_DECODER.decode, "kv sender", zero_copy=True, sndhwm=16)
    sender.connect(receiver.bind(f"ipc://{tmp_path}/kv"))
    payload = bytearray(b"\x07" * 100_000)
    header = Blocks(request_id="r", layer_start=0, layer_stop=1, dst_block_ids=[3], num_bytes=len(payload))
    tracker = sender.send(header, memoryview(payload), flags=zmq.NOBLOCK, track=True)
    got = receive(receiver)
    assert got.message == header and len(got.data) == 1 and got.data[0].bytes == bytes(payload)
    assert tracker is not None
    tracker.wait(5)
    sender.socket.send_multipart([encode(header), b"1", b"2"])  # two data frames: more than the socket takes
    receiver.send(Grant(request_id="r", dst_block_ids=[3]), to=got.sender)
    assert receive(sender).message == Grant(request_id="r", dst_block_ids=[3])
    deadline = time.monotonic() + 5
    while receiver.num_bad_frames == 0:
        assert time.monotonic() < deadline
        receiver.socket.poll(50)
        assert receiver.receive() is None
    sender.close()
    receiver.close()


def test_socket_options_are_set_in_one_place(ctx):
    sock = open_socket(ctx, zmq.DEALER, identity="w1", sndhwm=7, rcvhwm=9)
    assert sock.getsockopt(zmq.LINGER) == 0
    assert sock.getsockopt(zmq.IDENTITY) == b"w1"
    assert sock.getsockopt(zmq.SNDHWM) == 7 and sock.getsockopt(zmq.RCVHWM) == 9
    sock.close()


def test_asyncio_socket_skips_bad_frames_and_send_errors_raise(tmp_path):
    async def main():
        actx = zmq.asyncio.Context()
        server = TypedSocket(actx, zmq.ROUTER, decode_decode_to_prefill, "async", router_mandatory=True)
        endpoint = server.bind(f"ipc://{tmp_path}/async")
        client = open_socket(actx, zmq.DEALER, identity="d1")
        client.connect(endpoint)
        await client.send(b"\xc1 garbage")
        await client.send(encode(REQUEST))
        got = await asyncio.wait_for(server.receive_async(), 5)
        assert got.message == REQUEST and got.sender == b"d1" and server.num_bad_frames == 1
        server.send(PrefillAccepted(request_id="a"), to=b"d1", flags=zmq.NOBLOCK)
        assert decode_prefill_to_decode(await asyncio.wait_for(client.recv(), 5)) == PrefillAccepted(request_id="a")
        with pytest.raises(zmq.ZMQError):  # ROUTER_MANDATORY: an unknown peer fails now
            server.send(PrefillAccepted(request_id="a"), to=b"nobody", flags=zmq.NOBLOCK)
        server.close()
        client.close()
        actx.term()

    asyncio.run(main())
