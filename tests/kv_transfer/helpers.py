"""Helpers for the KV transfer tests: random caches and polling both ends until done."""

from __future__ import annotations

import itertools
import time

import torch

SHAPE = (4, 2, 24, 4, 2, 8)  # [num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim]
TRANSPORT_CASES = ["zmq-tcp", "zmq-ipc", "shm"]
names = itertools.count()  # unique shm / ipc names within a run


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
