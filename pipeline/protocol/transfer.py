"""Wire frames of the KV transfer service (prefill worker P -> decode worker D), torch-free.

One DEALER socket on P per destination talks to one ROUTER socket on D. Every message is a small
msgspec header frame; a ``Blocks`` header is followed by exactly one raw KV frame (the packed blocks,
sent zero-copy, never inside msgpack). Order of one request on its channel::

    P -> D  Hello(layout)                      first contact with an endpoint, once
    D -> P  HelloReply(ok | error, transport)  refusal names every differing layout field
    P -> D  Begin(request)                     in place (shm, cuda_ipc) only: ask for the write grant
    D -> P  Grant(request, dst blocks)         in place only: P may now write these blocks in place
    P -> D  Blocks(...) + KV frame  | Written(...)   one per piece, in order
    P -> D  Finish(checksum, payload)          after the last KV bytes, same channel
    D -> P  FinishAck(ok | error)              P frees its blocks only after this

Either side may stop a request early: D sends ``Revoke`` (P stops writing and answers ``RevokeAck``),
P sends ``SenderAbort``. Each direction is one tagged union decoded by one typed decoder.
"""

from __future__ import annotations

import msgspec

# Transport names in preference order for "auto": CUDA IPC when both caches are on GPUs of one host, shared memory
# when both ends share /dev/shm, else ZMQ (over whatever scheme the receiver bound: tcp:// across hosts, ipc:// on
# one host). The in-place ones have the sender write into the receiver's cache under a grant (Begin / Grant /
# Written); ZMQ carries the bytes in Blocks frames.
TRANSPORTS: tuple[str, ...] = ("cuda_ipc", "shm", "zmq")
IN_PLACE_TRANSPORTS: frozenset[str] = frozenset({"cuda_ipc", "shm"})
DTYPE_SIZES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
# Fields that must be equal on both ends; ``transports`` is negotiated instead.
LAYOUT_FIELDS: tuple[str, ...] = ("model_hash", "dtype", "page_size", "num_layers", "kv_kind", "num_kv_heads",
                                  "head_dim", "layer_windows")
# What a layer holds per block: "kv" a K page and a V page ([num_layers, 2, ...] caches), "latent" one page
# of latent rows (multi-head latent attention: [num_layers, 1, num_blocks, page_size, 1, latent_dim]).
KV_KINDS: dict[str, int] = {"kv": 2, "latent": 1}  # kind -> pages per layer and block


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Compatibility record exchanged at first contact: a mismatch is refused, never transferred."""

    model_hash: str
    dtype: str  # a DTYPE_SIZES key
    page_size: int  # tokens per block
    num_layers: int
    num_kv_heads: int
    head_dim: int
    transports: tuple[str, ...] = TRANSPORTS  # what this end accepts, in preference order
    kv_kind: str = "kv"  # a KV_KINDS key (last, with a default: records of older processes still decode)
    # Each layer's attention window in tokens, 0 for full attention; empty: every layer full. A sliding
    # layer's blocks outside the window its sink can still attend to are never sent (kv_transfer/sliding_window.py).
    layer_windows: tuple[int, ...] = ()
    # How many ranks hold this end's heads (tensor parallelism). Not compared: every end sends and receives the
    # full-head layout and re-slices for its own ranks (kv_transfer/sharded_cache.py), so any two sizes agree.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPE_SIZES)} (got {self.dtype!r})")
        if self.kv_kind not in KV_KINDS:
            raise ValueError(f"kv_kind: must be one of {', '.join(KV_KINDS)} (got {self.kv_kind!r})")
        for name in ("page_size", "num_layers", "num_kv_heads", "head_dim", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1 (got {getattr(self, name)!r})")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0):
            raise ValueError(f"layer_windows: must be empty or one window >= 0 per layer ({self.num_layers}; "
                             f"got {self.layer_windows!r})")
        unknown = [t for t in self.transports if t not in TRANSPORTS]
        if unknown or not self.transports:
            raise ValueError(f"transports: must be a non-empty subset of {TRANSPORTS} (got {self.transports!r})")

    @property
    def page_bytes(self) -> int:
        """Bytes of one (layer, K or V or latent, block) page."""
        return self.page_size * self.num_kv_heads * self.head_dim * DTYPE_SIZES[self.dtype]

    @property
    def pages_per_layer(self) -> int:
        """Pages of one block in one layer: 2 (K and V) or 1 (latent)."""
        return KV_KINDS[self.kv_kind]

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer (its K and V pages, or its latent page)."""
        return self.pages_per_layer * self.page_bytes

    @property
    def attention_windows(self) -> tuple[int, ...]:
        """Each layer's attention window (0: full attention), whether or not the record spells them out."""
        return self.layer_windows or (0,) * self.num_layers

    def kv_bytes(self, num_blocks: int, num_layers: int | None = None) -> int:
        """Bytes a transfer of ``num_blocks`` blocks over ``num_layers`` layers (default: all) moves."""
        return (self.num_layers if num_layers is None else num_layers) * num_blocks * self.layer_block_bytes

    def mismatch(self, other: "KVLayout", ours: str = "ours", theirs: str = "theirs") -> list[str]:
        """One ``"field: ours X != theirs Y"`` line per differing field; empty when compatible."""
        return [
            f"{name}: {ours} {getattr(self, name)!r} != {theirs} {getattr(other, name)!r}"
            for name in LAYOUT_FIELDS
            if getattr(self, name) != getattr(other, name)
        ]


class _Frame(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    pass


# ---- P -> D -------------------------------------------------------------------------------------


class Hello(_Frame, tag="hello"):
    layout: KVLayout
    host_id: str  # equal on both ends <=> they share /dev/shm
    # the sender's process (kv_transfer.process_identity): an in-place writer known to have exited is not waited for
    process: str = ""


class Begin(_Frame, tag="begin"):
    request_id: str


class Blocks(_Frame, tag="blocks"):
    """Header of one piece: the next frame holds ``[layer_stop - layer_start, pages_per_layer (2, or 1 for a
    latent cache), len(dst_block_ids), page_size, num_kv_heads, head_dim]`` packed in the layout's dtype."""

    request_id: str
    layer_start: int
    layer_stop: int
    dst_block_ids: list[int]
    num_bytes: int


class Written(_Frame, tag="written"):
    """Same piece description as ``Blocks``, for bytes P already wrote into D's shared cache."""

    request_id: str
    layer_start: int
    layer_stop: int
    dst_block_ids: list[int]
    num_bytes: int


class Finish(_Frame, tag="finish"):
    request_id: str
    num_bytes: int  # KV bytes of the whole request
    checksum: int  # kv_transfer.checksum over the whole request, uint64
    payload: bytes = b""  # opaque completion message (the decode worker's PrefillDone)


class SenderAbort(_Frame, tag="abort"):
    request_id: str
    reason: str = ""


class RevokeAck(_Frame, tag="revoke_ack"):
    request_id: str


SenderFrame = Hello | Begin | Blocks | Written | Finish | SenderAbort | RevokeAck

# ---- D -> P -------------------------------------------------------------------------------------


class CudaIpcHandle(msgspec.Struct, frozen=True, kw_only=True):
    """A CUDA allocation shared by one process with another on the same host: the fields torch's
    ``torch.multiprocessing.reductions`` exchanges for a CUDA tensor (``kv_transfer/cuda_ipc.py``)."""

    device: int  # the device index in the exporting process
    handle: bytes  # cudaIpcMemHandle of the allocation holding the storage
    storage_size_bytes: int
    storage_offset_bytes: int  # where the storage starts in that allocation
    tensor_offset: int  # elements from the storage's start to the cache's first one
    ref_counter_handle: bytes  # torch's producer-side use counter (a shared-memory file)
    ref_counter_offset: int
    event_handle: bytes = b""  # an event on the producer's stream to wait for before the first access
    event_sync_required: bool = False


class HelloReply(_Frame, tag="hello_reply"):
    ok: bool
    error: str = ""
    layout: KVLayout | None = None
    host_id: str = ""
    transport: str = ""  # the one both ends will use, a TRANSPORTS name
    shm_path: str = ""  # shm only: the receiver's KV cache file
    num_blocks: int = 0  # in place (shm, cuda_ipc) only: blocks in the receiver's cache
    cuda_ipc: CudaIpcHandle | None = None  # cuda_ipc only: the receiver's cache, for this sender


class Grant(_Frame, tag="grant"):
    request_id: str
    dst_block_ids: list[int]  # the reservation: P must not write outside it


class FinishAck(_Frame, tag="finish_ack"):
    request_id: str
    ok: bool
    error: str = ""


class Revoke(_Frame, tag="revoke"):
    """D dropped the request: P stops writing it at once and answers ``RevokeAck``."""

    request_id: str
    reason: str = ""


ReceiverFrame = HelloReply | Grant | FinishAck | Revoke

SENDER_FRAME_DECODER = msgspec.msgpack.Decoder(SenderFrame)
RECEIVER_FRAME_DECODER = msgspec.msgpack.Decoder(ReceiverFrame)
FRAME_ENCODER = msgspec.msgpack.Encoder()
