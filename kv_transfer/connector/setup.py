"""``ConnectorSetup``: the one place that builds a worker's ``KVSender`` and ``KVReceiver``, and the
connector halves around them, from the worker's KV cache tensor and its compatibility record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import zmq

from kv_transfer.connector.engine_port import SinkEngine, SourceEngine
from kv_transfer.connector.sink import KVSink
from kv_transfer.connector.source import KVSource
from kv_transfer.connector.source_links import SourceLinks
from kv_transfer.layout import kv_layout
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from pipeline.protocol.cluster import decode_decode_to_prefill
from pipeline.protocol.transfer import KVLayout
from pipeline.protocol.typed_socket import TypedSocket


@dataclass(frozen=True)
class ConnectorSetup:
    """What both halves of a worker's connector share: the cache they move, its layout, the kernels."""

    worker_id: str
    kv_cache: torch.Tensor  # [num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim] (draft layers too)
    layout: KVLayout
    kernel_backend: str

    @classmethod
    def build(cls, worker_id: str, kv_cache: torch.Tensor, model_fingerprint: str, transport: str,
              kernel_backend: str, layer_windows: Sequence[int | None] = ()) -> "ConnectorSetup":
        """``layer_windows``: each cache layer's sliding attention window (None: full), as the engine's
        ``kv.layer_windows``; a sliding layer's blocks outside the window never travel."""
        layout = kv_layout(kv_cache, model_fingerprint, transport, layer_windows)
        return cls(worker_id, kv_cache, layout, kernel_backend)

    def open_source(self, ctx: zmq.Context, engine: SourceEngine, bind: str, *, socket_name: str = "prefill socket",
                    sender_name: str = "kv-sender", logger=None) -> KVSource:
        """A source half: its sender, and the ROUTER socket bound at ``bind`` that sinks ask on."""
        socket = TypedSocket(ctx, zmq.ROUTER, decode_decode_to_prefill, socket_name, logger=logger)
        endpoint = socket.bind(bind)
        sender = KVSender(self.kv_cache, self.layout, kernel_backend=self.kernel_backend, name=sender_name)
        return KVSource(sender, socket, endpoint, engine)

    def open_sink(self, ctx: zmq.Context, engine: SinkEngine, bind: str, ttl_s: float) -> KVSink:
        """A sink half: its receiver bound at ``bind`` (sources write there) and its links to sources."""
        receiver = KVReceiver(self.kv_cache, self.layout, bind, kernel_backend=self.kernel_backend)
        return KVSink(receiver, SourceLinks(ctx, self.worker_id), engine, self.worker_id, ttl_s)
