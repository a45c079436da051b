"""The sender's connections: one DEALER socket per receiver endpoint, its handshake state, the receiver's cache
opened here for an in-place transport (a shm mapping, a CUDA IPC handle).

Owned by the sender's I/O thread. A connection is opened (and ``Hello`` queued) on first use of an
endpoint; after a failure or a long idle spell it is closed and the next request opens a fresh one. An
in-place transport the receiver chose but this process cannot open is dropped from that connection's offer and
the handshake is made again (``rehandshake``), so the bytes take the next transport instead of failing.
Each is a typed socket (``pipeline/protocol/typed_socket.py``) that decodes the receiver's frames.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import numpy as np
import torch
import zmq

from kv_transfer import cuda_ipc
from kv_transfer.data_path import byte_pages
from kv_transfer.shm import open_shared_kv_cache
from pipeline.protocol.transfer import RECEIVER_FRAME_DECODER, Hello, HelloReply, KVLayout, ReceiverFrame
from pipeline.protocol.typed_socket import TypedSocket

SEND_HWM = 16  # queued messages per receiver (pieces are <= 4 MiB): back-pressure instead of memory


@dataclass(eq=False)
class Peer:
    endpoint: str
    sock: TypedSocket[ReceiverFrame]
    since: float
    is_ready: bool = False
    offered: tuple[str, ...] = field(default_factory=tuple)  # the transports our last Hello offered
    transport: str = ""
    shm_pages: np.ndarray | None = None  # shm: the receiver's KV cache, mapped here (``byte_pages``)
    device_cache: torch.Tensor | None = None  # cuda_ipc: the receiver's KV cache, opened here
    blocked_until: float = 0.0
    last_used: float = 0.0


class PeerTable:
    def __init__(self, ctx: zmq.Context, poller: zmq.Poller, hello: Hello, layout: KVLayout,
                 kv_cache: torch.Tensor, on_bad_frame: Callable[[], object], logger: logging.Logger) -> None:
        self._ctx = ctx
        self._poller = poller
        self._hello = hello
        self._on_bad_frame = on_bad_frame
        self._logger = logger
        self._layout = layout
        self._kv_cache = kv_cache
        self._by_endpoint: dict[str, Peer] = {}
        self._by_socket: dict[zmq.Socket, Peer] = {}  # by the zmq socket the poller reports

    def get(self, endpoint: str, now: float) -> Peer:
        """The connection to ``endpoint``, opened (with ``Hello`` queued first) if there is none."""
        peer = self._by_endpoint.get(endpoint)
        if peer is None:
            sock = TypedSocket(self._ctx, zmq.DEALER, RECEIVER_FRAME_DECODER.decode, "KV sender", zero_copy=True,
                               on_bad_frame=self._on_bad_frame, logger=self._logger, sndhwm=SEND_HWM)
            try:
                sock.connect(endpoint)
                sock.send(self._hello, flags=zmq.NOBLOCK)  # first message on a fresh pipe: always queued
            except zmq.ZMQError:
                sock.close()
                raise
            peer = self._by_endpoint[endpoint] = self._by_socket[sock.socket] = Peer(
                endpoint, sock, now, offered=self._hello.layout.transports)
            self._poller.register(sock.socket, zmq.POLLIN)
        peer.last_used = now
        return peer

    def of_socket(self, sock: zmq.Socket) -> Peer | None:
        return self._by_socket.get(sock)

    def is_open(self, peer: Peer) -> bool:
        return self._by_endpoint.get(peer.endpoint) is peer

    def all(self) -> list[Peer]:
        return list(self._by_endpoint.values())

    def open_transport(self, peer: Peer, reply: HelloReply) -> str | None:
        """Finish the handshake the receiver accepted (open its cache for an in-place transport); an error string if
        that fails."""
        shape = (self._layout.num_layers, self._layout.pages_per_layer, reply.num_blocks, *self._kv_cache.shape[3:])
        if reply.transport == "shm":
            try:
                peer.shm_pages = byte_pages(open_shared_kv_cache(reply.shm_path, shape, self._kv_cache.dtype))
            except (OSError, ValueError, RuntimeError) as exc:
                return f"shm transport to {peer.endpoint}: cannot map {reply.shm_path}: {exc}"
        elif reply.transport == "cuda_ipc":
            if reply.cuda_ipc is None:
                return f"cuda_ipc transport to {peer.endpoint}: the reply carries no IPC handle"
            try:
                peer.device_cache = cuda_ipc.open_cache(reply.cuda_ipc, shape, self._kv_cache.dtype)
            except Exception as exc:  # noqa: BLE001 - a handle that does not open, however: the next transport
                return f"cuda_ipc transport to {peer.endpoint}: cannot open the receiver's cache: {exc}"
        peer.is_ready, peer.transport = True, reply.transport
        return None

    def rehandshake(self, peer: Peer, offered: tuple[str, ...]) -> None:
        """Say ``Hello`` again on ``peer``'s connection, offering only ``offered`` (the receiver answers anew)."""
        peer.offered = offered
        layout = msgspec.structs.replace(self._hello.layout, transports=offered)
        peer.sock.send(msgspec.structs.replace(self._hello, layout=layout), flags=zmq.NOBLOCK)

    def close(self, peer: Peer, linger: int) -> None:
        self._by_endpoint.pop(peer.endpoint, None)
        self._by_socket.pop(peer.sock.socket, None)
        self._poller.unregister(peer.sock.socket)
        peer.sock.close(linger=linger)
        peer.shm_pages = peer.device_cache = None  # unmapped / closed once no piece refers to it
