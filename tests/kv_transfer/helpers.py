"""Helpers for the KV transfer tests: random caches and polling both ends until done."""

from __future__ import annotations

import itertools
import time

import torch

from kv_transfer import cuda_ipc
from pipeline.protocol.transfer import CudaIpcHandle

SHAPE = (4, 2, 24, 4, 2, 8)  # [num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim]
TRANSPORT_CASES = ["zmq-tcp", "zmq-ipc", "shm", "cuda_ipc-emulated"]
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


def emulate_cuda_ipc(monkeypatch, *caches: torch.Tensor) -> None:
    """CUDA IPC where there is no GPU: ``caches`` (CPU tensors) count as CUDA caches, an exported handle names one,
    and opening it gives that very tensor (sender and receiver share this process). Only the CUDA calls are
    replaced: the handshake, grant, in-place write, checksum and revoke are the transport's own code."""
    by_handle = {f"cache-{id(cache)}".encode(): cache for cache in caches}

    def export(cache: torch.Tensor) -> CudaIpcHandle:
        return CudaIpcHandle(device=0, handle=f"cache-{id(cache)}".encode(),
                             storage_size_bytes=cache.numel() * cache.element_size(), storage_offset_bytes=0,
                             tensor_offset=0, ref_counter_handle=b"counter", ref_counter_offset=0)

    def open_cache(handle: CudaIpcHandle, shape, dtype) -> torch.Tensor:
        cache = by_handle[handle.handle]
        assert tuple(cache.shape) == tuple(shape) and cache.dtype == dtype, (cache.shape, shape, dtype)
        return cache

    monkeypatch.setattr(cuda_ipc, "can_export", lambda cache: any(cache is c for c in caches))
    monkeypatch.setattr(cuda_ipc, "export_cache", export)
    monkeypatch.setattr(cuda_ipc, "open_cache", open_cache)
