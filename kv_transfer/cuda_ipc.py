"""A decode worker's CUDA KV cache opened in a prefill worker's process (CUDA IPC), so pieces are written in place.

The ``cuda_ipc`` transport is the device twin of ``shm``: the receiver exports its cache's IPC handle once, when it
is built and before any step runs (``export_cache``: torch swaps the storage's deleter for its IPC reference
counting, which must not race a running step), and hands it to each sender on the same host at handshake; a sender
opens it once per connection (``open_cache``) and
copies each granted piece device to device, then announces it with ``Written``; the grant, revoke and checksum
protocol is the shm one. Both ends use torch's own CUDA IPC sharing (``torch.multiprocessing.reductions``: the
handle, its reference counter and the producer's event), never a second implementation of it.

Only a plain CUDA tensor is offered (a tensor-parallel worker's ``ShardedKVCache`` moves over ZMQ, re-sliced per
rank). The sender checks the opened tensor against the layout before its first write; a handle that does not open
(another container without the GPU, a driver refusing IPC) is a handshake error, and the sender then handshakes
again without ``cuda_ipc`` (``kv_transfer/sender.py``), so the transfer goes over the next transport.
"""

from __future__ import annotations

import logging
import math

import torch

from pipeline.protocol.transfer import CudaIpcHandle

log = logging.getLogger(__name__)


def can_export(kv_cache: object) -> bool:
    """Whether ``kv_cache`` can be offered over CUDA IPC: one contiguous CUDA tensor."""
    return isinstance(kv_cache, torch.Tensor) and kv_cache.device.type == "cuda" and kv_cache.is_contiguous()


def export_or_none(kv_cache: torch.Tensor) -> CudaIpcHandle | None:
    """A receiver's cache handle, made once before any step runs (every sender opens the same one), or None where
    it cannot be shared (not a CUDA tensor, or the allocator refuses: then the other transports serve)."""
    if not can_export(kv_cache):
        return None
    try:
        return export_cache(kv_cache)
    except Exception as exc:  # noqa: BLE001 - never run on a GPU yet: whatever fails, the other transports serve
        log.warning("KV receiver: cannot share the KV cache over CUDA IPC (%s); cuda_ipc is not offered", exc)
        return None


def export_cache(kv_cache: torch.Tensor) -> CudaIpcHandle:
    """The IPC handle of ``kv_cache``'s memory. Every sender opens this one handle: torch's producer-side counter
    then only matters when the cache is freed, at the receiver's exit."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(kv_cache.detach())
    (_cls, _size, _stride, tensor_offset, _storage_cls, _dtype, device, handle, storage_size_bytes,
     storage_offset_bytes, _requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
     event_sync_required) = args
    return CudaIpcHandle(
        device=int(device), handle=bytes(handle), storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes), tensor_offset=int(tensor_offset),
        ref_counter_handle=bytes(ref_counter_handle), ref_counter_offset=int(ref_counter_offset),
        event_handle=bytes(event_handle or b""), event_sync_required=bool(event_sync_required))


def open_cache(handle: CudaIpcHandle, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The receiver's cache ``shape`` / ``dtype`` mapped into this process (on the receiver's device index); the
    memory stays valid while the returned tensor lives. Raises ``ValueError`` when the handle's memory cannot hold
    ``shape`` and ``RuntimeError`` when CUDA refuses the handle."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    needed = (handle.tensor_offset + math.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if needed > handle.storage_size_bytes:
        raise ValueError(f"the exported memory has {handle.storage_size_bytes} bytes, the layout needs {needed}")
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available in this process")
    stride = torch.empty(shape, device="meta").stride()
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(shape), stride, handle.tensor_offset, torch.storage.TypedStorage, dtype,
        handle.device, handle.handle, handle.storage_size_bytes, handle.storage_offset_bytes, False,
        handle.ref_counter_handle, handle.ref_counter_offset, handle.event_handle,
        handle.event_sync_required)


def synchronize(*devices: torch.device) -> None:
    """Wait until the work queued on each CUDA ``device`` is done (a no-op for CPU tensors): a piece written into
    another process's memory must be complete before ``Written`` tells it so."""
    for device in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(device)
