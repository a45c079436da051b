"""KV between workers of different tensor-parallel layouts: each end packs or lands the full-head layout from or
into its ranks' shards (``ShardedKVCache``), so the bytes on the wire and the checksum are a TP 1 transfer's, and
every rank ends up holding exactly its own heads of the sender's KV (a head several ranks share, in each)."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from kv_transfer import KVReceiver, KVSender, kv_layout
from kv_transfer.sharded_cache import ShardedKVCache
from pipeline.parallel.shard_spec import ShardSpec
from tests.kv_transfer.helpers import random_cache, wait_for

NUM_KV_HEADS = 4
SHAPE = (3, 2, 20, 4, NUM_KV_HEADS, 8)  # [num_layers, 2, num_blocks, page_size, num_kv_heads, head_dim]
_ipc_names = itertools.count()


def model_config(num_kv_heads: int):
    from transformers import LlamaConfig

    return LlamaConfig(num_attention_heads=8, num_key_value_heads=num_kv_heads, head_dim=SHAPE[5], hidden_size=64,
                       intermediate_size=64, vocab_size=100)


def split(full: torch.Tensor, size: int) -> ShardedKVCache:
    """``full``'s heads as ``size`` tensor-parallel ranks hold them (``ShardSpec``: blocks of heads, or one shared
    head per rank when there are fewer heads than ranks), each shard a copy of its own."""
    config = model_config(full.shape[4])
    specs = [ShardSpec.of(config, rank, size) for rank in range(size)]
    shards = [full[:, :, :, :, s.first_kv_head:s.first_kv_head + s.num_local_kv_heads].contiguous() for s in specs]
    return ShardedKVCache(shards, [s.first_kv_head for s in specs], full.shape[4])


def gather(cache: ShardedKVCache) -> torch.Tensor:
    """The full cache back from the shards, checking that ranks sharing a head hold the same values."""
    full = torch.full(tuple(cache.shape), float("nan"))
    for first, shard in zip(cache.first_heads, cache.shards):
        heads = full[:, :, :, :, first:first + shard.shape[4]]
        known = ~heads.isnan()
        assert torch.equal(heads[known], shard[known]), "two ranks sharing a head disagree"
        heads.copy_(shard)
    return full


def layout_of(cache) -> int:
    return kv_layout(cache, "tiny").tensor_parallel_size


@pytest.mark.parametrize("sizes", [(1, 2), (2, 1), (2, 4), (4, 2), (4, 1), (1, 4)])
@pytest.mark.parametrize("num_kv_heads", [NUM_KV_HEADS, 2])
def test_a_transfer_between_layouts_lands_every_rank_its_heads(sizes, num_kv_heads, caplog):
    """Prefill TP a -> decode TP b over ZMQ, any a and b, fewer KV heads than ranks too (2 heads, 4 ranks)."""
    shape = (*SHAPE[:4], num_kv_heads, SHAPE[5])
    source_full, sink_full = random_cache(shape, seed=1), torch.zeros(shape)
    source = source_full if sizes[0] == 1 else split(source_full, sizes[0])
    sink = sink_full if sizes[1] == 1 else split(sink_full, sizes[1])
    layout = kv_layout(source, "tiny")
    assert layout.transports == ("zmq",) or sizes[0] == 1
    assert [layout_of(source), layout_of(sink)] == list(sizes)
    src_ids, dst_ids = [3, 4, 5, 11, 0], [7, 8, 9, 1, 15]
    expected_bytes = layout.kv_bytes(len(dst_ids))
    caplog.set_level(logging.INFO, logger="kv_transfer.receiver")
    with KVReceiver(sink, kv_layout(sink, "tiny"), f"ipc:///tmp/tandem-test-sharded-{next(_ipc_names)}") as receiver, \
            KVSender(source, layout) as sender:
        receiver.expect("r", dst_ids, num_bytes=expected_bytes)
        sender.send_blocks("r", receiver.endpoint, src_ids[:2], dst_ids[:2], layers=slice(0, 1))
        sender.send_blocks("r", receiver.endpoint, src_ids[:2], dst_ids[:2], layers=slice(1, None))
        sender.send_blocks("r", receiver.endpoint, src_ids[2:], dst_ids[2:])
        sender.finish("r", b"done")
        (got,), (status,) = wait_for(receiver, sender, 1, 1, timeout=20)
    assert got.ok and status.ok and got.payload == b"done", (got, status)
    # the compatibility record carries each end's rank count: the receiver says when the two differ
    resliced = [r.getMessage() for r in caplog.records if "re-slices" in r.getMessage()]
    if sizes[0] == sizes[1]:
        assert resliced == []
    else:
        assert len(resliced) == 1 and f"({sizes[0]} tensor-parallel ranks) to this receiver ({sizes[1]})" in resliced[0]
    assert got.num_bytes == status.num_bytes == expected_bytes  # the bytes of a TP 1 -> TP 1 transfer
    landed = sink_full if sizes[1] == 1 else gather(sink)
    assert torch.equal(landed[:, :, dst_ids], source_full[:, :, src_ids])
    untouched = [b for b in range(shape[2]) if b not in dst_ids]
    assert not landed[:, :, untouched].any()


def test_pack_reads_each_head_once_and_unpack_writes_every_replica():
    full = random_cache((2, 2, 6, 4, 2, 8), seed=3)
    sharded = split(full, 4)  # heads 0, 0, 1, 1
    assert sharded.first_heads == [0, 0, 1, 1]
    assert torch.equal(sharded.pack([4, 1, 2], slice(1, 2)), full[1:2, :, [4, 1, 2]])
    target = split(torch.zeros_like(full), 4)
    target.unpack(full[:, :, [0, 5]].contiguous(), [2, 3], slice(None))
    for shard, first in zip(target.shards, target.first_heads):
        assert torch.equal(shard[:, :, [2, 3]], full[:, :, [0, 5], :, first:first + 1])


def test_a_sharded_cache_refuses_the_in_place_transport_and_heads_no_shard_holds():
    sharded = split(random_cache(SHAPE), 2)
    with pytest.raises(ValueError, match="'shm' writes one cache in place"):
        kv_layout(sharded, "tiny", "shm")
    with pytest.raises(ValueError, match=r"KV heads \[2, 3\] are in no shard"):
        ShardedKVCache(sharded.shards[:1], [0], NUM_KV_HEADS)
    with pytest.raises(ValueError, match="does not match shard 0"):
        ShardedKVCache([sharded.shards[0], sharded.shards[1][:, :, :5].contiguous()], [0, 2], NUM_KV_HEADS)
