"""The cuda_ipc transport's choice and its ways out on this CPU machine; the bytes themselves round-trip in
test_roundtrip.py / test_faults.py ("cuda_ipc-emulated") and, on a GPU, between two processes in
tests/gpu/test_cuda_ipc.py.

An in-place transport the receiver picks but the sender cannot open (CUDA IPC refused, /dev/shm not mapped in
this container) must not fail the transfer: the sender handshakes again without it and the bytes take the next
transport."""

from __future__ import annotations

import pytest
import torch

from kv_transfer import KVReceiver, KVSender, allocate_shared_kv_cache, cuda_ipc, kv_layout, sender_peers
from kv_transfer.handshake import negotiate
from pipeline.config import ConfigError, PipelineConfig
from pipeline.protocol.transfer import CudaIpcHandle, Hello
from tests.kv_transfer.helpers import emulate_cuda_ipc, names, random_cache, wait_for


def _pair(closer, src: torch.Tensor, dst: torch.Tensor, transport: str = "auto") -> tuple[KVSender, KVReceiver]:
    """A receiver over ``dst`` offering what it can, and a sender over ``src`` offering ``transport``."""
    receiver = KVReceiver(dst, kv_layout(dst, "m"), "tcp://127.0.0.1:0")
    closer(receiver)
    sender = KVSender(src, kv_layout(src, "m", transport))
    closer(sender)
    return sender, receiver


def _raise(exc: Exception):
    def fail(*args):
        raise exc
    return fail


def _send_one(sender: KVSender, receiver: KVReceiver, src: torch.Tensor, dst: torch.Tensor):
    receiver.expect("r", [5, 6, 7], num_bytes=sender.layout.kv_bytes(3))
    sender.send_blocks("r", receiver.endpoint, [0, 1, 2], [5, 6, 7])
    sender.finish("r", b"done")
    (got,), (status,) = wait_for(receiver, sender, 1, 1)
    assert got.ok and status.ok, (got, status)
    assert torch.equal(dst[:, :, 5:8], src[:, :, 0:3])
    return got, status


def test_cuda_ipc_is_preferred_between_device_caches_on_one_host(closer, monkeypatch):
    src, dst = random_cache(), torch.zeros_like(random_cache())
    emulate_cuda_ipc(monkeypatch, src, dst)
    sender, receiver = _pair(closer, src, dst)
    assert receiver.layout.transports == ("cuda_ipc", "zmq") and sender.layout.transports == ("cuda_ipc", "shm", "zmq")
    got, status = _send_one(sender, receiver, src, dst)
    assert got.transport == status.transport == "cuda_ipc"
    assert sender.stats().num_transport_fallbacks == 0


def test_cuda_ipc_needs_one_host():
    layout = kv_layout(torch.zeros(2, 2, 4, 2, 1, 4), "m")  # "auto": every transport, in preference order
    assert negotiate(layout, Hello(layout=layout, host_id="here"), "here") == ("cuda_ipc", "")
    assert negotiate(layout, Hello(layout=layout, host_id="elsewhere"), "here") == ("zmq", "")


def test_a_cuda_ipc_handle_that_does_not_open_falls_back_to_the_next_transport(closer, monkeypatch, caplog):
    src, dst = random_cache(), torch.zeros_like(random_cache())
    emulate_cuda_ipc(monkeypatch, src, dst)
    monkeypatch.setattr(cuda_ipc, "open_cache", _raise(RuntimeError("CUDA error: invalid resource handle")))
    sender, receiver = _pair(closer, src, dst)
    got, status = _send_one(sender, receiver, src, dst)
    assert got.transport == status.transport == "zmq"
    assert sender.stats().num_transport_fallbacks == 1
    assert "cannot open the receiver's cache: CUDA error: invalid resource handle; handshaking again with shm, zmq" \
        in caplog.text
    # the connection keeps the transport it fell back to: a second request does not try CUDA IPC again
    receiver.expect("r2", [9], num_bytes=sender.layout.kv_bytes(1))
    sender.send_blocks("r2", receiver.endpoint, [3], [9])
    sender.finish("r2")
    (got,), (status,) = wait_for(receiver, sender, 1, 1)
    assert got.ok and status.transport == "zmq" and sender.stats().num_transport_fallbacks == 1


def test_a_shared_cache_that_does_not_map_falls_back_to_zmq(closer, monkeypatch):
    src = random_cache()
    dst = allocate_shared_kv_cache(src.shape, src.dtype, f"fallback-{next(names)}")
    dst.zero_()
    monkeypatch.setattr(sender_peers, "open_shared_kv_cache",
                        _raise(OSError(2, "No such file or directory (another container's /dev/shm?)")))
    sender, receiver = _pair(closer, src, dst)
    got, status = _send_one(sender, receiver, src, dst)
    assert got.transport == status.transport == "zmq" and sender.stats().num_transport_fallbacks == 1


def test_a_forced_in_place_transport_that_does_not_open_fails_clearly(closer, monkeypatch):
    src = random_cache()
    dst = allocate_shared_kv_cache(src.shape, src.dtype, f"forced-{next(names)}")
    monkeypatch.setattr(sender_peers, "open_shared_kv_cache", _raise(OSError(13, "Permission denied")))
    sender, receiver = _pair(closer, src, dst, "shm")  # nothing else offered: nothing to fall back to
    receiver.expect("r", [1])
    sender.send_blocks("r", receiver.endpoint, [0], [1])
    sender.finish("r")
    status = wait_for(None, sender, 0, 1)[1][0]
    assert not status.ok and "shm transport to" in status.error and "Permission denied" in status.error


def test_a_receiver_that_cannot_export_its_cache_stops_offering_cuda_ipc(closer, monkeypatch):
    src, dst = random_cache(), torch.zeros_like(random_cache())
    emulate_cuda_ipc(monkeypatch, src, dst)
    monkeypatch.setattr(cuda_ipc, "export_cache", _raise(RuntimeError("the allocator cannot share this memory")))
    sender, receiver = _pair(closer, src, dst)
    assert receiver.layout.transports == ("zmq",)
    got, status = _send_one(sender, receiver, src, dst)
    assert got.transport == "zmq"


def test_cuda_ipc_needs_caches_on_a_cuda_device(closer):
    cache = random_cache()
    assert not cuda_ipc.can_export(cache)
    with pytest.raises(ValueError, match="'cuda_ipc' needs a kv_cache on a CUDA device"):
        KVSender(cache, kv_layout(cache, "m", transport="cuda_ipc"))
    with pytest.raises(ValueError, match=r"\('cuda_ipc',\) need a kv_cache .* or on a CUDA device"):
        KVReceiver(cache, kv_layout(cache, "m", transport="cuda_ipc"), "tcp://127.0.0.1:0")
    # "auto" on CPU caches simply leaves it out
    receiver = KVReceiver(cache, kv_layout(cache, "m"), "tcp://127.0.0.1:0")
    closer(receiver)
    assert receiver.layout.transports == ("zmq",)


def test_opening_a_handle_checks_its_size_and_needs_cuda():
    handle = CudaIpcHandle(device=0, handle=b"h", storage_size_bytes=100, storage_offset_bytes=0, tensor_offset=0,
                           ref_counter_handle=b"c", ref_counter_offset=0)
    with pytest.raises(ValueError, match="the exported memory has 100 bytes, the layout needs 512"):
        cuda_ipc.open_cache(handle, (2, 2, 4, 2, 1, 4), torch.float32)
    if not torch.cuda.is_available():
        big = CudaIpcHandle(**{**{f: getattr(handle, f) for f in handle.__struct_fields__}, "storage_size_bytes": 4096})
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            cuda_ipc.open_cache(big, (2, 2, 4, 2, 1, 4), torch.float32)


def test_the_config_names_cuda_ipc_and_refuses_it_for_tensor_parallel_transfers():
    config = PipelineConfig.load(overrides={"transfer": {"transport": "cuda_ipc"}})
    assert config.transfer.transport == "cuda_ipc"
    with pytest.raises(ConfigError, match="'cuda_ipc' writes one cache in place"):
        PipelineConfig.load(overrides={"transfer": {"transport": "cuda_ipc"}, "pipeline_role": "DecodeOnly",
                                       "tensor_parallel_size": 2})
