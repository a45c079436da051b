"""The KV transfer service: a prefill worker's ``KVSender`` pushes KV blocks into a decode worker's
``KVReceiver``, straight into the blocks D reserved, with the completion message after the last byte.

Modules, one sentence each:

- ``interface``: the polling contract and what it reports (``ReceivedTransfer``, ``SendStatus``, stats).
- ``receiver`` / ``sender``: the two halves, each one background I/O thread (``io_thread``).
- ``layout``: the compatibility record (``pipeline.protocol.transfer.KVLayout``) of a KV cache tensor.
- ``handshake``: the compatibility check and transport choice at first contact.
- ``blocks``: argument and piece checks, runs of consecutive blocks, splitting a send into <= 4 MiB pieces.
- ``data_path``: moving a piece's bytes (pack for the wire, in-place copy, landing), checksummed as they go.
- ``checksum``: the position-weighted 64-bit checksum both ends compute over their own cache.
- ``connector``: the KV connector pair every cross-worker KV move goes through (``KVSource``, ``KVSink``).
- ``shm``: KV caches in /dev/shm for the same-host transport; ``shm_files``: their names and removal (torch-free).

Transports ("auto" picks the first both ends accept, shared memory only on the same host):
``"shm"`` (the sender copies straight into the receiver's shared cache) and ``"zmq"`` (packed blocks as
raw zero-copy frames over the receiver's tcp:// or ipc:// address).
Measured throughput against raw baselines: ``bench/transfer_bench.py``, ``docs/benchmarks.md``.
"""

import importlib

# Names load on first use (PEP 562), so torch-free parts such as ``kv_transfer.shm_files`` can be
# imported by a launcher without the package pulling in torch.
_EXPORTS = {
    "ReceivedTransfer": "kv_transfer.interface", "SendStatus": "kv_transfer.interface",
    "TransferStats": "kv_transfer.interface", "TransportStats": "kv_transfer.interface",
    "check_kv_cache": "kv_transfer.layout", "kv_layout": "kv_transfer.layout",
    "KVReceiver": "kv_transfer.receiver", "KVSender": "kv_transfer.sender",
    "allocate_shared_kv_cache": "kv_transfer.shm", "free_shared_kv_cache": "kv_transfer.shm",
    "remove_stale_shared_kv_caches": "kv_transfer.shm", "shared_kv_path": "kv_transfer.shm",
    "TRANSPORTS": "pipeline.protocol.transfer", "KVLayout": "pipeline.protocol.transfer",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "TRANSPORTS",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "ReceivedTransfer",
    "SendStatus",
    "TransferStats",
    "TransportStats",
    "allocate_shared_kv_cache",
    "check_kv_cache",
    "free_shared_kv_cache",
    "kv_layout",
    "remove_stale_shared_kv_caches",
    "shared_kv_path",
]
