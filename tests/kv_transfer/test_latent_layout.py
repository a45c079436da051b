"""The latent KV layout (multi-head latent attention): its compatibility record, sizes and mismatches."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kv_transfer.layout import check_kv_cache, kv_layout
from pipeline.protocol.transfer import FRAME_ENCODER, SENDER_FRAME_DECODER, Hello


def test_latent_record_counts_one_page_per_layer_and_block():
    latent = torch.zeros(3, 1, 8, 16, 1, 48, dtype=torch.bfloat16)  # [layers, 1, blocks, page, 1, latent_dim]
    layout = kv_layout(latent, "abc")
    assert (layout.kv_kind, layout.pages_per_layer, layout.num_kv_heads, layout.head_dim) == ("latent", 1, 1, 48)
    assert layout.kv_bytes(5) == 3 * 5 * 16 * 48 * 2  # layers * blocks * page_size * latent_dim * bf16
    assert layout.kv_bytes(5, num_layers=1) == 5 * 16 * 48 * 2
    check_kv_cache(latent, layout)


def test_latent_and_kv_layouts_refuse_each_other_by_name():
    latent = kv_layout(torch.zeros(2, 1, 4, 16, 1, 32), "m")
    kv = kv_layout(torch.zeros(2, 2, 4, 16, 1, 32), "m")  # same head geometry, K and V pages
    assert kv.kv_kind == "kv" and kv.kv_bytes(1) == 2 * latent.kv_bytes(1)
    assert latent.mismatch(kv, ours="receiver", theirs="sender") == ["kv_kind: receiver 'latent' != sender 'kv'"]
    with pytest.raises(ValueError, match="kv_kind"):
        check_kv_cache(torch.zeros(2, 1, 4, 16, 1, 32), kv)


def test_a_latent_cache_has_one_head_and_kinds_are_checked():
    with pytest.raises(ValueError, match="latent"):
        kv_layout(torch.zeros(2, 1, 4, 16, 2, 32), "m")  # one page per layer but two heads: no such layout
    record = kv_layout(torch.zeros(2, 1, 4, 16, 1, 32), "m")
    with pytest.raises(ValueError, match="kv_kind"):
        msgspec.structs.replace(record, kv_kind="sliding")


def test_hello_without_a_kind_decodes_as_kv():
    """A Hello from a process that predates kv_kind still decodes (the field is last, with a default)."""
    record = kv_layout(torch.zeros(2, 2, 4, 16, 1, 32), "m")
    fields = msgspec.to_builtins(record)
    assert fields.pop("kv_kind") == "kv"
    frame = msgspec.msgpack.encode(["hello", fields, "h"])  # the tagged array a Hello is on the wire
    assert SENDER_FRAME_DECODER.decode(frame) == Hello(layout=record, host_id="h")
    assert SENDER_FRAME_DECODER.decode(FRAME_ENCODER.encode(Hello(layout=record, host_id="h"))).layout == record
