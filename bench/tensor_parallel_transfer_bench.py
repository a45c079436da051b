"""The cost of re-slicing KV between tensor-parallel layouts: one request's transfer, TP a -> TP b, same bytes.

A request of ``--blocks`` blocks of the TinyLlama-1.1B shape's KV (22 layers, 4 KV heads of 64, pages of 16 tokens,
bf16: 11 MiB for 64 blocks) goes from a ``KVSender`` to a ``KVReceiver`` over ZMQ (ipc://, this process, each on
its I/O thread), from and into caches of each layout: TP 1 (one tensor: the native copy-and-checksum path) or TP
2 / TP 4 (``ShardedKVCache`` over that many rank shards: each head packed from the rank that owns it, landed in every
rank that holds it). The clock runs from the first ``send_blocks`` to the receiver's verified completion; the
variants take turns (``--repeats`` rounds) and each one's median and best are reported with the bytes/s. The
destination blocks are checked against the source after every run. Usage:
``python -m bench.tensor_parallel_transfer_bench --out bench/results/tensor_parallel_transfer.json``
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch

from bench.quantization_bench import cpu_description
from kv_transfer import KVReceiver, KVSender, kv_layout
from kv_transfer.sharded_cache import ShardedKVCache

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)]
_names = itertools.count()


def shard(full: torch.Tensor, size: int):
    """``full`` as ``size`` ranks hold it (a block of heads each), or ``full`` itself for one rank."""
    if size == 1:
        return full
    per_rank = full.shape[4] // size
    shards = [full[:, :, :, :, r * per_rank:(r + 1) * per_rank].contiguous() for r in range(size)]
    return ShardedKVCache(shards, [r * per_rank for r in range(size)], full.shape[4])


def gathered(cache) -> torch.Tensor:
    return cache if isinstance(cache, torch.Tensor) else torch.cat(cache.shards, dim=4)


def one_transfer(sender: KVSender, receiver: KVReceiver, src_ids: list[int], dst_ids: list[int]) -> float:
    request_id = f"r{next(_names)}"
    start = time.perf_counter()
    receiver.expect(request_id, dst_ids)
    sender.send_blocks(request_id, receiver.endpoint, src_ids, dst_ids)
    sender.finish(request_id)
    received = []
    while not received:
        received = receiver.poll(timeout_s=5.0)
    elapsed = time.perf_counter() - start
    statuses = []
    while not statuses:
        statuses = sender.poll()
        time.sleep(0.0005)
    assert received[0].ok and statuses[0].ok, (received, statuses)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=64, help="blocks in the request")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="bench/results/tensor_parallel_transfer.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = (args.layers, 2, args.blocks * 2, args.page_size, args.kv_heads, args.head_dim)
    source = torch.randn(shape).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    src_ids = torch.randperm(shape[2], generator=generator)[:args.blocks].sort().values.tolist()
    dst_ids = torch.randperm(shape[2], generator=generator)[:args.blocks].sort().values.tolist()
    ends = {}
    for a, b in LAYOUTS:
        src, dst = shard(source, a), shard(torch.zeros(shape, dtype=torch.bfloat16), b)
        receiver = KVReceiver(dst, kv_layout(dst, "bench", "zmq"), f"ipc:///tmp/tandem-tp-transfer-bench-{a}{b}")
        ends[f"TP {a} -> TP {b}"] = (KVSender(src, kv_layout(src, "bench", "zmq")), receiver, dst)
    num_bytes = kv_layout(source, "bench").kv_bytes(args.blocks)
    times = {name: [] for name in ends}
    try:
        for name, (sender, receiver, dst) in ends.items():  # warm-up: handshakes, buffers; then the check
            one_transfer(sender, receiver, src_ids, dst_ids)
            assert torch.equal(gathered(dst)[:, :, dst_ids], source[:, :, src_ids]), name
        for _ in range(args.repeats):
            for name, (sender, receiver, _) in ends.items():
                times[name].append(one_transfer(sender, receiver, src_ids, dst_ids))
    finally:
        for sender, receiver, _ in ends.values():
            sender.close()
            receiver.close()
    baseline = statistics.median(times["TP 1 -> TP 1"])
    results = {name: {"median_ms": statistics.median(t) * 1e3, "best_ms": min(t) * 1e3,
                      "median_gb_per_s": num_bytes / statistics.median(t) / 1e9,
                      "vs_tp1_to_tp1": statistics.median(t) / baseline} for name, t in times.items()}
    report = {"cpu": cpu_description(), "shape": list(shape), "dtype": "bfloat16", "blocks": args.blocks,
              "bytes_per_transfer": num_bytes, "repeats": args.repeats, "transport": "zmq (ipc://, one process)",
              "results": results}
    for name, row in results.items():
        print(f"{name}: median {row['median_ms']:.2f} ms ({row['median_gb_per_s']:.2f} GB/s), best "
              f"{row['best_ms']:.2f} ms, {row['vs_tp1_to_tp1']:.2f}x TP 1 -> TP 1's time")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
