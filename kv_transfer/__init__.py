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
- ``shm``: KV caches in /dev/shm for the same-host transport, and cleanup of crash leftovers.

Transports ("auto" picks the first both ends accept, shared memory only on the same host):
``"shm"`` (the sender copies straight into the receiver's shared cache) and ``"zmq"`` (packed blocks as
raw zero-copy frames over the receiver's tcp:// or ipc:// address).
Measured throughput against raw baselines: ``bench/transfer_bench.py``, ``docs/benchmarks.md``.
"""

from kv_transfer.interface import ReceivedTransfer, SendStatus, TransferStats, TransportStats
from kv_transfer.layout import check_kv_cache, kv_layout
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from kv_transfer.shm import (
    allocate_shared_kv_cache,
    free_shared_kv_cache,
    remove_stale_shared_kv_caches,
    shared_kv_path,
)
from pipeline.protocol.transfer import TRANSPORTS, KVLayout

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
