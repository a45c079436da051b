"""Fixtures for the KV transfer tests: sender/receiver pairs on loopback that are always closed."""

from __future__ import annotations

import itertools
import os
import threading
import time

import pytest
import torch

from kv_transfer import KVReceiver, KVSender, allocate_shared_kv_cache, kv_layout

SHAPE = (4, 2, 24, 4, 2, 8)  # [num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim]
TRANSPORT_CASES = ["zmq-tcp", "zmq-ipc", "shm"]
_names = itertools.count()


def random_cache(shape=SHAPE, dtype=torch.float32, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def wait_for(receiver=None, sender=None, num_received=0, num_sent=0, timeout=5.0):
    """Poll both ends until the counts are reached; returns (received, statuses)."""
    received, statuses = [], []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if receiver is not None:
            received += receiver.poll()
        if sender is not None:
            statuses += sender.poll()
        if len(received) >= num_received and len(statuses) >= num_sent:
            return received, statuses
        time.sleep(0.002)
    raise AssertionError(f"timed out: received {received}, statuses {statuses}")


@pytest.fixture
def closer():
    """Collects services and closes them (in reverse order) after the test, whatever happened."""
    threads_before = threading.active_count()
    items = []
    yield items.append
    for item in reversed(items):
        item.close()
    deadline = time.monotonic() + 2
    while threading.active_count() > threads_before and time.monotonic() < deadline:
        time.sleep(0.01)  # pyzmq's garbage-collector thread may take a moment
    assert threading.active_count() <= threads_before + 1, "a transfer thread outlived close()"


@pytest.fixture
def make_pair(closer, tmp_path):
    """``make_pair(case, dtype=..., shape=..., timeout_s=...)`` -> (sender, receiver, src_cache, dst_cache)."""

    def make(case: str, dtype=torch.float32, shape=SHAPE, timeout_s=5.0, model_hash="tiny", seed=0):
        src = random_cache(shape, dtype, seed)
        if case == "shm":
            dst = allocate_shared_kv_cache(shape, dtype, f"test-{os.getpid()}-{next(_names)}")
            dst.zero_()
        else:
            dst = torch.zeros(shape, dtype=dtype)
        bind = f"ipc://{tmp_path}/rx-{next(_names)}" if case == "zmq-ipc" else "tcp://127.0.0.1:0"
        transport = "shm" if case == "shm" else "zmq"
        receiver = KVReceiver(dst, kv_layout(dst, model_hash), bind, timeout_s=timeout_s)
        closer(receiver)
        sender = KVSender(src, kv_layout(src, model_hash, transport), timeout_s=timeout_s)
        closer(sender)
        return sender, receiver, src, dst

    return make
