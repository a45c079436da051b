"""What the two halves of the transfer service report: finished transfers, send statuses, counters.

Contract (progress by polling, no callbacks; every request ends in exactly one report; ``poll(timeout_s)``
may wait that long for the first report instead of returning at once):

Receiver on D, ``KVReceiver``::

    expect(rid, dst_block_ids)        before D sends PrefillRequest{endpoint, dst_block_ids} to P
    poll() -> [ReceivedTransfer]      ok=True: every byte landed and the checksum matched; payload is
                                      P's completion message. ok=False: error says why. Either way the
                                      receiver will never write those blocks again.
    abort(rid)                        TTL expiry / cancel: the next poll() reports it (ok=False,
                                      "aborted"); only then may D reuse the blocks

Sender on P, ``KVSender``::

    send_blocks(rid, endpoint, src, dst, layers=None)   any number of times, in order
    finish(rid, payload)                                after the last send_blocks
    poll() -> [SendStatus]            ok=True: D verified the transfer; P may free its blocks.
                                      ok=False: failed (refused, revoked, timed out, aborted).
    abort(rid)                        P drops the request; reported once by poll() as failed
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReceivedTransfer:
    """A request the receiver is done with (successfully or not)."""

    request_id: str
    ok: bool
    error: str | None = None  # size mismatch, checksum mismatch, unknown/aborted request, refused, ...
    payload: bytes = b""  # the sender's completion message, as sent with finish(); use it only if ok
    num_bytes: int = 0  # KV bytes that landed
    transport: str = ""  # "zmq", "shm" or "cuda_ipc"; "" if no bytes ever came
    seconds: float = 0.0  # from reservation to completion


@dataclass(frozen=True)
class SendStatus:
    """A request the sender is done with: ``ok`` means the receiver verified it, so P may free its blocks."""

    request_id: str
    ok: bool
    error: str | None = None
    num_bytes: int = 0
    transport: str = ""
    seconds: float = 0.0  # from the first send_blocks to the receiver's acknowledgement

    @property
    def failed(self) -> bool:
        return not self.ok


@dataclass
class TransportStats:
    num_transfers: int = 0  # finished ok
    num_failed: int = 0
    num_bytes: int = 0  # KV bytes moved (sender: sent, receiver: landed)
    busy_seconds: float = 0.0  # time spent moving bytes: pack+send / in-place copy / unpack+verify
    transfer_seconds: float = 0.0  # summed over finished transfers, first byte to acknowledgement

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.busy_seconds / 1e9 if self.busy_seconds else 0.0


@dataclass
class TransferStats:
    """Counters a worker exports; read them through ``stats()``, which returns a consistent copy."""

    transports: dict[str, TransportStats] = field(default_factory=dict)  # "zmq", "shm", "cuda_ipc"
    num_transfers: int = 0  # finished ok, all transports
    num_failed: int = 0  # failed or aborted, all transports (also those that never picked one)
    num_bad_frames: int = 0  # frames that failed to decode or validate: counted, logged, dropped
    num_late_dropped: int = 0  # messages for aborted / failed / unknown requests, discarded unwritten
    num_refused_handshakes: int = 0
    num_checksum_mismatches: int = 0
    num_timeouts: int = 0
    num_transport_fallbacks: int = 0  # sender: a receiver's in-place transport would not open here; the next was used

    def transport(self, name: str) -> TransportStats:
        return self.transports.setdefault(name, TransportStats())


class StatsBox:
    """``TransferStats`` owned by an I/O thread and snapshotted by others."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stats = TransferStats()

    def snapshot(self) -> TransferStats:
        with self.lock:
            return copy.deepcopy(self.stats)

    def count(self, name: str) -> int:
        """Add one to the counter ``name`` (e.g. "num_bad_frames"); returns the new value."""
        with self.lock:
            value = getattr(self.stats, name) + 1
            setattr(self.stats, name, value)
            return value

    def add_bytes(self, transport: str, num_bytes: int, busy_seconds: float) -> None:
        with self.lock:
            t = self.stats.transport(transport)
            t.num_bytes += num_bytes
            t.busy_seconds += busy_seconds

    def end_transfer(self, transport: str, ok: bool, seconds: float) -> None:
        """One request ended; ``transport`` is "" when it never got far enough to pick one."""
        with self.lock:
            self.stats.num_transfers += ok
            self.stats.num_failed += not ok
            if transport:
                t = self.stats.transport(transport)
                t.num_transfers += ok
                t.num_failed += not ok
                t.transfer_seconds += seconds if ok else 0.0
