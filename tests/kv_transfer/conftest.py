"""Fixtures for the KV transfer tests: sender/receiver pairs on loopback that are always closed."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import zmq

from kv_transfer import KVReceiver, KVSender, allocate_shared_kv_cache, kv_layout
from tests.kv_transfer.helpers import SHAPE, emulate_cuda_ipc, names, random_cache


@pytest.fixture
def closer():
    """Collects services and closes them (in reverse order) after the test, whatever happened."""
    items = []
    yield items.append
    for item in reversed(items):
        item.close()
    alive = [t.name for t in threading.enumerate() if t.name.startswith(("kv-sender", "kv-receiver"))]
    assert not alive, f"transfer threads outlived close(): {alive}"


@pytest.fixture
def make_pair(closer, tmp_path, monkeypatch):
    """``make_pair(case, dtype=..., shape=..., timeout_s=...)`` -> (sender, receiver, src_cache, dst_cache); case
    "cuda_ipc-emulated" runs the cuda_ipc transport over CPU caches (``emulate_cuda_ipc``)."""

    def make(case: str, dtype=torch.float32, shape=SHAPE, timeout_s=5.0, model_hash="tiny", seed=0):
        src = random_cache(shape, dtype, seed)
        if case == "shm":
            dst = allocate_shared_kv_cache(shape, dtype, f"test-{os.getpid()}-{next(names)}")
            dst.zero_()
        else:
            dst = torch.zeros(shape, dtype=dtype)
        bind = f"ipc://{tmp_path}/rx-{next(names)}" if case == "zmq-ipc" else "tcp://127.0.0.1:0"
        transport = {"shm": "shm", "cuda_ipc-emulated": "cuda_ipc"}.get(case, "zmq")
        if case == "cuda_ipc-emulated":
            emulate_cuda_ipc(monkeypatch, src, dst)
        receiver = KVReceiver(dst, kv_layout(dst, model_hash), bind, timeout_s=timeout_s)
        closer(receiver)
        sender = KVSender(src, kv_layout(src, model_hash, transport), timeout_s=timeout_s)
        closer(sender)
        return sender, receiver, src, dst

    return make


@pytest.fixture
def raw_socket():
    """``raw_socket(kind)`` -> a bare ZMQ socket (a misbehaving peer), closed after the test."""
    ctx = zmq.Context()
    sockets = []

    def make(kind: int) -> zmq.Socket:
        sockets.append(ctx.socket(kind))
        return sockets[-1]

    yield make
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()
