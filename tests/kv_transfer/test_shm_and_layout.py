"""Shared-memory caches (allocation, cleanup, crash leftovers), compatibility records, block helpers."""

from __future__ import annotations

import errno
import os
import platform
import re
import subprocess
import sys

import msgspec
import pytest
import torch

from kv_transfer import (
    KVLayout, KVReceiver, allocate_shared_kv_cache, check_kv_cache, kv_layout, remove_stale_shared_kv_caches,
    shared_kv_path,
)
from kv_transfer.blocks import paired_runs, split_pieces
from kv_transfer import shm
from kv_transfer.shm import SHM_DIR, open_shared_kv_cache, prefault
from pipeline.protocol.transfer import FRAME_ENCODER, SENDER_FRAME_DECODER, Finish, Hello
from tests.kv_transfer.helpers import names


def test_shared_cache_is_shared_and_removed_on_close():
    shape = (2, 2, 4, 2, 1, 4)
    cache = allocate_shared_kv_cache(shape, torch.bfloat16, f"close-{os.getpid()}-{next(names)}")
    path = shared_kv_path(cache)
    assert path is not None and path.startswith(SHM_DIR) and os.path.exists(path)
    other = open_shared_kv_cache(path, shape, torch.bfloat16)  # what a sender maps
    other[1, 0, 3] = 2.5
    assert torch.all(cache[1, 0, 3] == 2.5)
    receiver = KVReceiver(cache, kv_layout(cache, "m"), "tcp://127.0.0.1:0")
    try:
        assert receiver.layout.transports == ("shm", "zmq")
    finally:
        receiver.close()
    assert not os.path.exists(path)
    assert torch.all(cache[1, 0, 3] == 2.5)  # still mapped here until dropped
    with pytest.raises(FileNotFoundError):
        open_shared_kv_cache(path, shape, torch.bfloat16)


def test_a_full_dev_shm_is_a_clear_error_at_allocation_and_leaves_no_file(monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", no_space)
    name = f"full-{next(names)}"
    with pytest.raises(OSError, match=r"not enough shared memory for the KV cache: it needs .* GiB.*--shm-size.*"
                                      r"or set transfer.transport to zmq"):
        allocate_shared_kv_cache((2, 2, 4, 2, 1, 4), torch.float32, name)
    assert not os.path.exists(os.path.join(SHM_DIR, f"tandem-kv.{os.getpid()}.{name}"))
    # a tensor-parallel rank's cache is in shared memory whatever the transport: its own way out
    with pytest.raises(OSError, match=r"--shm-size.*num_blocks, or give the worker fewer ranks$"):
        allocate_shared_kv_cache((2, 2, 4, 2, 1, 4), torch.float32, name, remedy="or give the worker fewer ranks")


def test_memory_is_committed_and_mappings_prefaulted_without_changing_data():
    shape = (2, 2, 64, 16, 2, 32)
    cache = allocate_shared_kv_cache(shape, torch.float16, f"commit-{next(names)}")
    path = shared_kv_path(cache)
    try:
        assert os.stat(path).st_blocks * 512 >= cache.numel() * cache.element_size()  # allocated, not sparse
        cache.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(3)).half())
        other = open_shared_kv_cache(path, shape, torch.float16)
        kernel = tuple(int(x) for x in re.findall(r"\d+", platform.release())[:2])
        assert prefault(other) is (kernel >= (5, 14))  # MADV_POPULATE_WRITE came in Linux 5.14
        assert torch.equal(other, cache)
    finally:
        os.unlink(path)


def test_stale_files_of_dead_processes_are_removed():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = os.path.join(SHM_DIR, f"tandem-kv.{int(dead.stdout)}.leftover")
    mine = allocate_shared_kv_cache((1, 2, 1, 1, 1, 2), torch.float32, f"alive-{next(names)}")
    with open(stale, "wb") as f:
        f.write(b"\0" * 64)
    try:
        removed = remove_stale_shared_kv_caches()
        assert stale in removed and not os.path.exists(stale)
        assert os.path.exists(shared_kv_path(mine))  # a live owner keeps its file
    finally:
        if os.path.exists(stale):
            os.unlink(stale)
        os.unlink(shared_kv_path(mine))


def test_layout_record_and_mismatch_message():
    cache = torch.zeros(4, 2, 8, 16, 2, 64, dtype=torch.float16)
    layout = kv_layout(cache, "abc")
    assert (layout.dtype, layout.page_size, layout.num_layers, layout.num_kv_heads, layout.head_dim) == (
        "float16", 16, 4, 2, 64)
    assert layout.page_bytes == 16 * 2 * 64 * 2 and layout.kv_bytes(3) == 4 * 2 * 3 * layout.page_bytes
    other = msgspec.structs.replace(layout, head_dim=128, model_hash="xyz")
    problems = layout.mismatch(other, ours="receiver", theirs="sender")
    assert problems == ["model_hash: receiver 'abc' != sender 'xyz'", "head_dim: receiver 64 != sender 128"]
    assert layout.mismatch(msgspec.structs.replace(layout, transports=("zmq",))) == []
    with pytest.raises(ValueError, match="head_dim"):
        check_kv_cache(cache, other)
    with pytest.raises(ValueError, match="transport"):
        kv_layout(cache, "abc", transport="rdma")
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(model_hash="a", dtype="int8", page_size=1, num_layers=1, num_kv_heads=1, head_dim=1)


def test_frames_round_trip_and_reject_garbage():
    layout = kv_layout(torch.zeros(1, 2, 1, 1, 1, 2), "m")
    for msg in (Hello(layout=layout, host_id="h"), Finish(request_id="r", num_bytes=8, checksum=2**64 - 1,
                                                          payload=b"\x00done")):
        assert SENDER_FRAME_DECODER.decode(FRAME_ENCODER.encode(msg)) == msg
    with pytest.raises(msgspec.DecodeError):
        SENDER_FRAME_DECODER.decode(FRAME_ENCODER.encode(["finish", "r", -1, "x"]))


def test_pieces_cover_every_page_once():
    src, dst = list(range(10)), [b + 20 for b in range(10)]
    for max_bytes in (10**9, 4 * 2 * 10 * 100, 2 * 3 * 100, 1):
        pieces = split_pieces(1, 5, src, dst, layer_block_bytes=200, max_bytes=max_bytes)  # K and V pages of 100
        covered = [(layer, s, d) for p in pieces for layer in range(p.layer_start, p.layer_stop)
                   for s, d in zip(p.src_block_ids, p.dst_block_ids)]
        assert sorted(covered) == [(layer, s, s + 20) for layer in range(1, 5) for s in src]
        assert all(p.num_bytes(200) <= max(max_bytes, 200) for p in pieces)
    assert paired_runs([1, 2, 3, 7, 8], [4, 5, 9, 10, 11]) == [(1, 4, 2), (3, 9, 1), (7, 10, 2)]
