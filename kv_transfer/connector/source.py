"""The source half of the KV connector: every worker that sends KV to another (a prefill worker, a
draining decode worker handing its streams off) keeps its transfers here, one record per request.

A request walks (``SourceStatus``)::

    UNCLAIMED ──claim──▶ QUEUED ──start──▶ SHIPPING ──finish──▶ FINISHING ──reap──▶ (gone: blocks freed)
       (hold)      accept ─┘                                         │
    any status ──drop──▶ DROPPING ──reap──▶ (gone)   (or gone at once when the sender never saw it)

- ``hold``: KV computed (or being computed) here for a sink that has not asked yet: an early prefill the
  router started, a paused stream offered to the router. Its deadline is the hold.
- ``accept`` / ``claim``: a sink's ``PrefillRequest`` (new, or for a held request) names the destination
  blocks; ``PrefillAccepted`` answers it. No TTL while queued here: a queue is load, not a fault.
- ``start``: the first chunk ran (or everything is there already): ``PrefillStarted`` tells the sink and
  the TTL starts on both sides. ``ship`` pushes every block that became complete.
- ``finish``: the last (partial) block, then the done message on the same ordered channel.
- ``reap``: the sender's verdict (the sink verified the transfer, or it failed): the blocks are freed.
- ``drop``: cancelled by the sink, TTL or hold passed, or the worker stops: a request the sender never
  saw ends at once; otherwise it stops computing and its blocks are freed when the sender lets go.

The owner (worker) decides what to accept and builds the done message; the source owns the sender, the
socket sinks ask on, and every block's way back.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from kv_transfer.connector.engine_port import SourceEngine
from kv_transfer.interface import SendStatus
from kv_transfer.sliding_window import plan_request
from pipeline.protocol.cluster import (
    CancelPrefill,
    DecodeToPrefill,
    PrefillAccepted,
    PrefillRejected,
    PrefillRequest,
    PrefillStarted,
    StartPrefill,
)
from pipeline.protocol.typed_socket import TypedSocket

logger = logging.getLogger(__name__)


class SourceStatus(enum.Enum):
    UNCLAIMED = "unclaimed"  # held for a sink that has not asked yet (deadline: the hold)
    QUEUED = "queued"  # a sink asked; waiting for the first chunk (no TTL)
    SHIPPING = "shipping"  # the sink was told PrefillStarted (TTL runs); complete blocks ship
    FINISHING = "finishing"  # the done message follows the last block; waiting for the sink's verdict
    DROPPING = "dropping"  # dropped while the sender may read its blocks; freed when it reports


@dataclass
class SourceTransfer:
    """One request this worker sends (or holds for sending)."""

    request_id: str  # the request's id here (the engine's)
    status: SourceStatus
    deadline: float  # the hold (UNCLAIMED), then the TTL counted from the last chunk computed; inf while queued
    ttl_s: float = math.inf  # from ``start``: how long it may go without a chunk computed (or the sink's verdict)
    request: PrefillRequest | None = None  # the sink's ask (destination blocks, endpoint), once it came
    reply_to: bytes | None = None  # the sink's routing id on the source socket
    num_skipped_blocks: int = 0  # leading destination blocks the sink already holds (its prefix cache)
    num_sent_blocks: int = 0  # leading destination blocks sent (those a sliding layer skips included) or on the sink
    is_open_at_sender: bool = False  # some blocks went to the sender (a plan may skip every layer of the first ones)
    early: StartPrefill | None = None  # prefill worker: the router's early start, until a sink claims it
    early_output: Any = None  # prefill worker: an unclaimed early prefill's result, kept for the claim

    @property
    def transfer_id(self) -> str | None:
        """The sender's (and the sink's) id of the transfer: the sink's request id, once it asked."""
        return self.request.request_id if self.request is not None else None

    @property
    def is_known_to_sender(self) -> bool:
        """Whether the sender has seen the request (it then reports it exactly once, and may read its blocks)."""
        return self.status in (SourceStatus.FINISHING, SourceStatus.DROPPING) or self.is_open_at_sender


class KVSource:
    """The sending half: ``receive`` the sinks' asks, ``hold`` / ``accept`` / ``claim``, ``start``, ``ship``,
    ``finish``, ``reap``, ``drop``, ``expire`` (see the module docstring)."""

    def __init__(self, sender, socket: TypedSocket[DecodeToPrefill], endpoint: str, engine: SourceEngine) -> None:
        self.sender = sender  # kv_transfer.sender.KVSender
        self.socket = socket  # bound; sinks send their asks and cancels here
        self.endpoint = endpoint
        self.engine = engine
        self.transfers: dict[str, SourceTransfer] = {}  # by request id here
        self._by_transfer_id: dict[str, str] = {}  # the sink's request id -> request id here
        self.num_holds_expired = 0  # held requests no sink claimed in time (cumulative: the load report's)

    # ------------------------------------------------------------ queries
    def get(self, request_id: str) -> SourceTransfer | None:
        return self.transfers.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.transfers

    def has_work(self) -> bool:
        return bool(self.transfers)

    def with_status(self, status: SourceStatus) -> list[SourceTransfer]:
        return [t for t in self.transfers.values() if t.status is status]

    @property
    def num_bad_frames(self) -> int:
        return self.socket.num_bad_frames

    def stats(self):
        return self.sender.stats()

    # ------------------------------------------------------------ asks
    def receive(self) -> list[tuple[bytes, PrefillRequest]]:
        """The sinks' messages: cancels are handled here (``drop``); asks go to the owner to decide. A cancel
        also withdraws its sink's ask read in the same batch (a sink cancels after it asked): handled after the
        cancel, that ask would start the prompt again."""
        asks = []
        for message, identity, _ in self.socket.receive_ready():
            if isinstance(message, CancelPrefill):
                asks = [(sink, ask) for sink, ask in asks if (sink, ask.request_id) != (identity, message.request_id)]
                request_id = self._by_transfer_id.get(message.request_id, message.request_id)
                self.drop(request_id, "cancelled by the decode worker")
            else:
                asks.append((identity, message))
        return asks

    def hold(self, request_id: str, hold_s: float = math.inf, early: StartPrefill | None = None) -> SourceTransfer:
        """Keep ``request_id`` for a sink that has not asked yet; dropped after ``hold_s`` unclaimed."""
        transfer = SourceTransfer(request_id, SourceStatus.UNCLAIMED, time.monotonic() + hold_s, early=early)
        self.transfers[request_id] = transfer
        return transfer

    def accept(self, reply_to: bytes, request: PrefillRequest) -> SourceTransfer:
        """A sink's ask for a request the owner just queued in its engine (under the sink's id)."""
        transfer = SourceTransfer(request.request_id, SourceStatus.UNCLAIMED, math.inf)
        self.transfers[request.request_id] = transfer
        return self.claim(request.request_id, reply_to, request)

    def claim(self, request_id: str, reply_to: bytes, request: PrefillRequest,
              acknowledge: bool = True) -> SourceTransfer:
        """A sink's ask for the held ``request_id``: UNCLAIMED -> QUEUED (answered ``PrefillAccepted``
        unless ``acknowledge`` is off)."""
        transfer = self.transfers[request_id]
        self._move(transfer, SourceStatus.UNCLAIMED, SourceStatus.QUEUED)
        transfer.request, transfer.reply_to, transfer.early, transfer.deadline = request, reply_to, None, math.inf
        transfer.num_skipped_blocks = transfer.num_sent_blocks = request.num_cached_tokens // self.engine.page_size
        self._by_transfer_id[request.request_id] = request_id
        if acknowledge:
            self.socket.send(PrefillAccepted(request_id=request.request_id), to=reply_to)
        return transfer

    def reject(self, reply_to: bytes, transfer_id: str, error: str, retryable: bool) -> None:
        self.socket.send(PrefillRejected(request_id=transfer_id, error=error, retryable=retryable), to=reply_to)

    # ------------------------------------------------------------ shipping
    def start(self, request_id: str, ttl_s: float | None = None) -> None:
        """QUEUED -> SHIPPING: tell the sink (``PrefillStarted``); the TTL (the request's unless given) runs, and
        runs again from each chunk computed after (a long prompt beside others is slow, not stuck)."""
        transfer = self.transfers[request_id]
        self._move(transfer, SourceStatus.QUEUED, SourceStatus.SHIPPING)
        transfer.ttl_s = transfer.request.ttl_s if ttl_s is None else ttl_s
        transfer.deadline = time.monotonic() + transfer.ttl_s
        self.socket.send(PrefillStarted(request_id=transfer.transfer_id), to=transfer.reply_to)

    def on_kv_written(self, written: list[tuple[str, int]]) -> None:
        """After an engine step, (request id, tokens whose KV is written) per chunk: a claimed request's first
        chunk starts it, and every block that became complete ships (the partial last one with ``finish``)."""
        for request_id, num_tokens in written:
            transfer = self.transfers.get(request_id)
            if transfer is None or transfer.status not in (SourceStatus.QUEUED, SourceStatus.SHIPPING):
                continue  # (unclaimed: the claim ships what is computed by then)
            if transfer.status is SourceStatus.QUEUED:
                self.start(request_id)
            else:
                transfer.deadline = time.monotonic() + transfer.ttl_s  # progress: the TTL runs again
            self.ship(request_id, num_tokens // self.engine.page_size)

    def ship(self, request_id: str, upto_block: int) -> None:
        """Send the blocks not sent yet below destination block ``upto_block``, each to the layers that need it
        (a sliding-window layer only inside the window the sink can still attend to: ``plan_request``)."""
        transfer = self.transfers[request_id]
        dst = transfer.request.dst_block_ids
        upto_block = min(upto_block, len(dst))
        if upto_block <= transfer.num_sent_blocks:
            return
        table = self.engine.block_table(request_id)
        for send in plan_request(self.sender.layout, transfer.request, transfer.num_sent_blocks, upto_block):
            self.sender.send_blocks(transfer.transfer_id, transfer.request.transfer_endpoint,
                                    table[send.block_start:send.block_stop], dst[send.block_start:send.block_stop],
                                    layers=send.layers)
            transfer.is_open_at_sender = True
        transfer.num_sent_blocks = upto_block

    def finish(self, request_id: str, done_payload: bytes, upto_block: int) -> None:
        """Ship what is left below ``upto_block``, then the done message after it: -> FINISHING."""
        transfer = self.transfers[request_id]
        if transfer.status is not SourceStatus.QUEUED:  # (a request finished before its first chunk was seen)
            self._move(transfer, SourceStatus.SHIPPING, SourceStatus.SHIPPING)
        self.ship(request_id, upto_block)
        if not transfer.is_known_to_sender:  # nothing to ship: open the request for its done message
            self.sender.send_blocks(transfer.transfer_id, transfer.request.transfer_endpoint, [], [])
        transfer.status = SourceStatus.FINISHING
        self.sender.finish(transfer.transfer_id, done_payload)

    # ------------------------------------------------------------ ends
    def reap(self) -> list[tuple[SourceTransfer, SendStatus]]:
        """The sender's verdicts: each such request is gone, its blocks freed (kept in the prefix cache)."""
        reaped = []
        for status in self.sender.poll():
            request_id = self._by_transfer_id.pop(status.request_id, None)
            transfer = self.transfers.pop(request_id, None) if request_id is not None else None
            if transfer is None:
                continue
            if not status.ok and transfer.status is not SourceStatus.DROPPING:
                logger.warning("request %s: KV transfer failed: %s", request_id, status.error)
            self.engine.abort_request(request_id)  # frees (or releases held) blocks: the sender let go
            reaped.append((transfer, status))
        return reaped

    def drop(self, request_id: str, reason: str) -> None:
        """End ``request_id`` here: at once if the sender never saw it, else once the sender lets go."""
        transfer = self.transfers.get(request_id)
        if transfer is None or transfer.status is SourceStatus.DROPPING:
            return
        logger.info("request %s dropped: %s", request_id, reason)
        if not transfer.is_known_to_sender:
            self._forget(transfer)
            self.engine.abort_request(request_id)
            return
        transfer.status = SourceStatus.DROPPING
        self.engine.abort_request(request_id, keep_blocks=True)  # stop computing; the sender may still read
        self.sender.abort(transfer.transfer_id)

    def release(self, request_id: str) -> None:
        """An UNCLAIMED request leaves the connector untouched (its owner keeps it: a declined handoff)."""
        transfer = self.transfers[request_id]
        if transfer.status is not SourceStatus.UNCLAIMED:
            raise ValueError(f"request {request_id!r}: only an UNCLAIMED request is released (it is {transfer.status.name})")
        self._forget(transfer)

    def expire(self, now: float | None = None) -> None:
        """Drop every request whose hold or TTL passed."""
        now = time.monotonic() if now is None else now
        for transfer in list(self.transfers.values()):
            if now > transfer.deadline and transfer.status is not SourceStatus.DROPPING:
                self.num_holds_expired += transfer.status is SourceStatus.UNCLAIMED
                self.drop(transfer.request_id, "no decode worker claimed it in time"
                          if transfer.status is SourceStatus.UNCLAIMED
                          else "TTL passed before the decode worker acknowledged the KV")

    def fail_all(self, reason: str) -> None:
        """The worker stops: sinks still waiting for a first byte are told (retryable), everything drops."""
        for transfer in list(self.transfers.values()):
            if not transfer.is_known_to_sender and transfer.reply_to is not None:
                self.reject(transfer.reply_to, transfer.transfer_id, reason, retryable=True)
            self.drop(transfer.request_id, reason)

    def close(self) -> None:
        self.sender.close()
        self.socket.close()

    # ------------------------------------------------------------ helpers
    def _forget(self, transfer: SourceTransfer) -> None:
        del self.transfers[transfer.request_id]
        if transfer.transfer_id is not None:
            self._by_transfer_id.pop(transfer.transfer_id, None)

    @staticmethod
    def _move(transfer: SourceTransfer, expected: SourceStatus, to: SourceStatus) -> None:
        if transfer.status is not expected:
            raise ValueError(f"request {transfer.request_id!r}: {transfer.status.name} -> {to.name} "
                             f"(only from {expected.name})")
        transfer.status = to
