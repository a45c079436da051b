"""Round trips over every transport: the bytes that land are exactly P's, and the payload comes last."""

from __future__ import annotations

import time

import pytest
import torch

from kv_transfer import KVReceiver, KVSender, kv_layout
from tests.kv_transfer.helpers import TRANSPORT_CASES, random_cache, wait_for

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _random_ids(num_blocks: int, n: int, seed: int) -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    src = torch.randperm(num_blocks, generator=gen)[:n].tolist()
    dst = torch.randperm(num_blocks, generator=gen)[:n].tolist()
    return src, dst


@pytest.mark.parametrize("case", TRANSPORT_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_round_trip_is_exact(make_pair, case, dtype):
    sender, receiver, src, dst = make_pair(case, dtype=dtype)
    num_layers, num_blocks = src.shape[0], src.shape[2]
    src_ids, dst_ids = _random_ids(num_blocks, 10, seed=1)
    before = dst.clone()
    receiver.expect("req-1", dst_ids, num_bytes=kv_layout(src, "tiny").kv_bytes(len(dst_ids)))
    # Chunked prefill: blocks 0-3 as two per-layer pushes, then blocks 4-9 whole, in two chunks.
    sender.send_blocks("req-1", receiver.endpoint, src_ids[:4], dst_ids[:4], layers=slice(0, 1))
    sender.send_blocks("req-1", receiver.endpoint, src_ids[:4], dst_ids[:4], layers=slice(1, num_layers))
    assert receiver.last_landed("req-1") is None or receiver.last_landed("req-1") <= time.monotonic()
    deadline = time.monotonic() + 10
    while receiver.last_landed("req-1") is None and time.monotonic() < deadline:  # the sink's TTL runs from it
        time.sleep(0.01)
    assert receiver.last_landed("req-1") is not None
    sender.send_blocks("req-1", receiver.endpoint, src_ids[4:7], dst_ids[4:7])
    sender.send_blocks("req-1", receiver.endpoint, src_ids[7:], dst_ids[7:], layers=None)
    sender.finish("req-1", b"prefill-done")

    (got,), (status,) = wait_for(receiver, sender, 1, 1)
    # When the completion is visible, every byte already landed.
    assert got.ok and got.error is None and got.payload == b"prefill-done"
    assert receiver.last_landed("req-1") is None  # ended: forgotten
    assert torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])
    untouched = [b for b in range(num_blocks) if b not in dst_ids]
    assert torch.equal(dst[:, :, untouched], before[:, :, untouched])
    assert status.ok and status.request_id == "req-1"
    expected_transport = {"shm": "shm", "cuda_ipc-emulated": "cuda_ipc"}.get(case, "zmq")
    assert got.transport == status.transport == expected_transport
    assert got.num_bytes == status.num_bytes == src[:, :, src_ids].numel() * src.element_size()
    rx, tx = receiver.stats(), sender.stats()
    assert rx.transports[expected_transport].num_bytes == got.num_bytes
    assert rx.num_transfers == tx.num_transfers == 1 and rx.num_failed == tx.num_failed == 0


@pytest.mark.parametrize("case", TRANSPORT_CASES)
def test_interleaved_requests_and_large_pieces(make_pair, case):
    # 8 layers x 2 x 16 blocks x 64 KiB pages = 16 MiB per cache: pieces are split below 4 MiB.
    shape = (8, 2, 16, 64, 8, 64)
    sender, receiver, src, dst = make_pair(case, shape=shape)
    jobs = {"a": _random_ids(16, 7, seed=2), "b": None}
    used = set(jobs["a"][1])
    free = [b for b in range(16) if b not in used]
    jobs["b"] = (list(range(9)), free[:9])
    for rid, (s, d) in jobs.items():
        receiver.expect(rid, d)
    for layer in range(8):  # layer-by-layer pushes, two requests interleaved
        for rid, (s, d) in jobs.items():
            sender.send_blocks(rid, receiver.endpoint, s, d, layers=layer)
    sender.finish("b", b"B")
    sender.finish("a", b"A")
    received, statuses = wait_for(receiver, sender, 2, 2, timeout=10)
    assert {r.request_id: r.payload for r in received if r.ok} == {"a": b"A", "b": b"B"}
    assert all(s.ok for s in statuses)
    for rid, (s, d) in jobs.items():
        assert torch.equal(dst[:, :, d], src[:, :, s]), rid


def test_two_senders_one_receiver_and_empty_request(closer):
    shape = (2, 2, 12, 4, 1, 8)
    dst = torch.zeros(shape)
    receiver = KVReceiver(dst, kv_layout(dst, "m"), "tcp://127.0.0.1:0")
    closer(receiver)
    caches = [random_cache(shape, seed=s) for s in (5, 6)]
    senders = [KVSender(c, kv_layout(c, "m")) for c in caches]
    for s in senders:
        closer(s)
    receiver.expect("p0", [0, 1, 2])
    receiver.expect("p1", [3, 4])
    receiver.expect("nothing-to-ship", [])  # every block was a prefix hit on D
    senders[0].send_blocks("p0", receiver.endpoint, [7, 8, 9], [0, 1, 2])
    senders[1].send_blocks("p1", receiver.endpoint, [1, 2], [3, 4])
    senders[1].send_blocks("nothing-to-ship", receiver.endpoint, [], [])
    for rid, s in (("p0", senders[0]), ("p1", senders[1]), ("nothing-to-ship", senders[1])):
        s.finish(rid, rid.encode())
    received = wait_for(receiver, None, 3)[0]
    assert sorted((r.request_id, r.ok, r.payload) for r in received) == [
        ("nothing-to-ship", True, b"nothing-to-ship"), ("p0", True, b"p0"), ("p1", True, b"p1")]
    assert torch.equal(dst[:, :, [0, 1, 2]], caches[0][:, :, [7, 8, 9]])
    assert torch.equal(dst[:, :, [3, 4]], caches[1][:, :, [1, 2]])
    assert len(wait_for(None, senders[0], 0, 1)[1]) == 1 and len(wait_for(None, senders[1], 0, 2)[1]) == 2


def test_request_id_can_be_reused_after_its_status(make_pair):
    sender, receiver, src, dst = make_pair("zmq-tcp")
    for attempt in range(2):
        receiver.expect("same-id", [attempt])
        sender.send_blocks("same-id", receiver.endpoint, [attempt + 5], [attempt])
        sender.finish("same-id")
        (got,), (status,) = wait_for(receiver, sender, 1, 1)
        assert got.ok and status.ok
    assert torch.equal(dst[:, :, [0, 1]], src[:, :, [5, 6]])


def test_poll_can_wait_for_the_first_report(make_pair):
    sender, receiver, src, dst = make_pair("zmq-tcp")
    start = time.monotonic()
    assert receiver.poll(timeout_s=0.05) == [] and sender.poll(timeout_s=0.05) == []
    assert time.monotonic() - start >= 0.1
    receiver.expect("r", [0, 3])
    sender.send_blocks("r", receiver.endpoint, [1, 2], [0, 3])
    sender.finish("r")
    (got,) = receiver.poll(timeout_s=5)  # returns as soon as the transfer is verified
    (status,) = sender.poll(timeout_s=5)
    assert got.ok and status.ok and torch.equal(dst[:, :, [0, 3]], src[:, :, [1, 2]])

