"""In-place writers (shm, cuda_ipc) told to stop: the receiver frees a revoked grant's blocks only once the
writer confirmed, stayed silent for the timeout, or its process has exited; a writer stalled mid-round reads its
revocations before its next write."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import torch
import zmq

from kv_transfer import KVReceiver, KVSender, kv_layout
from kv_transfer.process_identity import has_exited, own_identity
from kv_transfer.shm import host_id
from pipeline.protocol.transfer import FRAME_ENCODER, RECEIVER_FRAME_DECODER, Begin, Hello, HelloReply
from tests.kv_transfer.helpers import emulate_cuda_ipc, names, random_cache, wait_for


@pytest.mark.parametrize("transport", ["shm", "cuda_ipc"])
def test_an_in_place_abort_waits_until_the_writer_stopped(closer, raw_socket, monkeypatch, transport):
    """D may reuse blocks only once an in-place writer confirmed it stopped, or stayed silent too long."""
    from kv_transfer import allocate_shared_kv_cache

    shape = (2, 2, 4, 2, 1, 4)
    if transport == "shm":
        dst = allocate_shared_kv_cache(shape, torch.float32, f"writer-{next(names)}")
    else:
        dst = torch.zeros(shape)
        emulate_cuda_ipc(monkeypatch, dst)
    receiver = KVReceiver(dst, kv_layout(dst, "m"), "tcp://127.0.0.1:0", timeout_s=0.4)
    closer(receiver)
    writer = raw_socket(zmq.DEALER)  # an in-place sender that will ignore Revoke
    writer.connect(receiver.endpoint)
    writer.send(FRAME_ENCODER.encode(Hello(layout=kv_layout(dst, "m", transport=transport), host_id=host_id())))
    assert RECEIVER_FRAME_DECODER.decode(writer.recv()).transport == transport
    receiver.expect("r", [2, 3])
    writer.send(FRAME_ENCODER.encode(Begin(request_id="r")))
    assert RECEIVER_FRAME_DECODER.decode(writer.recv()).dst_block_ids == [2, 3]  # granted: may write now
    start = time.monotonic()
    receiver.abort("r")
    assert type(RECEIVER_FRAME_DECODER.decode(writer.recv())).__name__ == "Revoke"
    assert receiver.poll() == []  # not yet: the writer may still be copying
    (got,) = wait_for(receiver, None, 1)[0]
    assert time.monotonic() - start >= 0.35 and "writer silent" in got.error
    assert receiver.stats().num_timeouts == 1


def _identity_of(pid: int) -> str:
    namespace = os.stat("/proc/self/ns/pid").st_ino
    with open(f"/proc/{pid}/stat") as f:
        return f"{namespace}:{pid}:{f.read().rpartition(')')[2].split()[19]}"


def test_an_in_place_writer_whose_process_exited_is_not_waited_for(closer, raw_socket):
    """A SIGKILLed prefill worker cannot acknowledge a Revoke, nor write: its blocks come back at once, not after
    the receiver's timeout (an audit saw a decode worker hold them 10 s)."""
    from kv_transfer import allocate_shared_kv_cache

    dst = allocate_shared_kv_cache((2, 2, 4, 2, 1, 4), torch.float32, f"writer-{next(names)}")
    receiver = KVReceiver(dst, kv_layout(dst, "m"), "tcp://127.0.0.1:0", timeout_s=30.0)
    closer(receiver)
    writer_process = subprocess.Popen(["sleep", "60"])  # stands for the writer's process
    writer = raw_socket(zmq.DEALER)
    writer.connect(receiver.endpoint)
    writer.send(FRAME_ENCODER.encode(Hello(layout=kv_layout(dst, "m", transport="shm"), host_id=host_id(),
                                           process=_identity_of(writer_process.pid))))
    assert RECEIVER_FRAME_DECODER.decode(writer.recv()).transport == "shm"
    receiver.expect("r", [2, 3])
    writer.send(FRAME_ENCODER.encode(Begin(request_id="r")))
    assert RECEIVER_FRAME_DECODER.decode(writer.recv()).dst_block_ids == [2, 3]  # granted: may write now
    receiver.abort("r")
    time.sleep(0.5)
    assert receiver.poll() == []  # the writer's process runs: it may still be copying
    writer_process.kill()
    writer_process.wait()
    start = time.monotonic()
    (got,) = wait_for(receiver, None, 1)[0]
    assert time.monotonic() - start < 5 and "writer exited" in got.error
    assert receiver.stats().num_timeouts == 0


def test_a_sender_stalled_mid_round_reads_its_revocations_before_writing_in_place(closer, raw_socket, monkeypatch):
    """Once a receiver has revoked a grant and waited out its timeout, it reuses the blocks. A writer stopped
    (SIGSTOP, starved) in the middle of a round of writes must not go on into them when it resumes: after a stall
    of half the timeout it reads the receiver's messages (here a Revoke) before its next in-place write."""
    import kv_transfer.sender as sender_module
    from kv_transfer import allocate_shared_kv_cache
    from kv_transfer.shm import shared_kv_path
    from pipeline.protocol.transfer import SENDER_FRAME_DECODER, Grant, Revoke

    src = random_cache((2, 2, 4, 2, 1, 4))
    dst = allocate_shared_kv_cache(src.shape, torch.float32, f"stalled-{next(names)}")
    layout = kv_layout(src, "m", transport="shm")
    written_blocks: list[int] = []
    write = sender_module.write_piece_in_place

    def stalling_write(kv_cache, pages, dst_pages, piece, checksum):
        write(kv_cache, pages, dst_pages, piece, checksum)
        written_blocks.extend(piece.dst_block_ids)
        if len(written_blocks) == 1:
            time.sleep(0.5)  # stopped right after the round's first write

    monkeypatch.setattr(sender_module, "write_piece_in_place", stalling_write)
    receiver = raw_socket(zmq.ROUTER)  # plays the receiver, by hand
    receiver.bind("tcp://127.0.0.1:0")
    sender = KVSender(src, layout, timeout_s=0.6)
    closer(sender)
    endpoint = receiver.getsockopt_string(zmq.LAST_ENDPOINT)
    sender.send_blocks("a", endpoint, [0], [0])
    sender.send_blocks("b", endpoint, [1], [1])
    identity, _hello = receiver.recv_multipart()
    receiver.send_multipart([identity, FRAME_ENCODER.encode(HelloReply(
        ok=True, layout=layout, host_id=host_id(), transport="shm", shm_path=shared_kv_path(dst),
        num_blocks=dst.shape[2]))])
    begun = {SENDER_FRAME_DECODER.decode(receiver.recv_multipart()[1]).request_id for _ in range(2)}
    assert begun == {"a", "b"}
    for rid, block in (("a", 0), ("b", 1)):  # both granted at once: one round writes both
        receiver.send_multipart([identity, FRAME_ENCODER.encode(Grant(request_id=rid, dst_block_ids=[block]))])
    deadline = time.monotonic() + 5
    while not written_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    revoked = "b" if written_blocks == [0] else "a"  # the one not written yet
    receiver.send_multipart([identity, FRAME_ENCODER.encode(Revoke(request_id=revoked, reason="given up"))])
    time.sleep(1.0)
    assert len(written_blocks) == 1, "the stalled sender wrote into a grant the receiver had revoked"
    replies = []
    while receiver.poll(0):
        replies.append(SENDER_FRAME_DECODER.decode(receiver.recv_multipart()[1]))
    assert any(type(r).__name__ == "RevokeAck" and r.request_id == revoked for r in replies)


def test_process_identity_tells_an_exited_process_from_a_running_one():
    child = subprocess.Popen(["sleep", "60"])
    identity = _identity_of(child.pid)
    assert own_identity() == _identity_of(os.getpid()) and not has_exited(own_identity())
    assert not has_exited(identity)
    child.kill()
    time.sleep(0.2)
    assert has_exited(identity)  # a zombie writes nothing
    child.wait()
    assert has_exited(identity)
    namespace, pid, _ = own_identity().split(":")
    assert has_exited(f"{namespace}:{pid}:1")  # the pid is another (later) process's
    assert not has_exited(f"1:{pid}:1") and not has_exited("")  # another pid namespace, no identity: cannot tell
