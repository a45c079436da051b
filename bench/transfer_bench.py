"""KV transfer throughput per transport, against raw baselines measured in the same run.

P (this process) ships one request of ``--blocks`` whole blocks (64 MiB with the defaults: 16 layers x
K/V x 64 blocks x 16 tokens x 8 heads x 128 dims in fp16) to D, a separate process, and the clock runs
from the first ``send_blocks`` on P to the moment ``poll()`` on D returns the verified transfer.
Baselines: raw ZMQ PUSH/PULL of the same bytes over tcp loopback (zero-copy frames, both as one message
and as messages the size of the transport's pieces; the faster one is the reference) for the zmq transport, and a plain
``torch`` ``copy_`` of the same bytes for shm. Reports the median of ``--repeats`` runs as JSON.

    python -m bench.transfer_bench --out docs/transfer_bench.json [--plot docs/transfer_bench.png]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time

import msgspec
import torch
import zmq

from kv_transfer.blocks import MAX_PIECE_BYTES

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
TARGETS = {"zmq": 0.7, "shm": 0.5}


def _send(conn, **msg) -> None:  # control messages between the bench processes: JSON, not pickle
    conn.send_bytes(msgspec.json.encode(msg))


def _recv(conn) -> dict:
    return msgspec.json.decode(conn.recv_bytes())


def decode_side(conn, mode: str, shape: list[int], dtype: str, num_threads: int) -> None:
    """D: a KVReceiver (zmq / shm) or a bare PULL socket (raw), driven over ``conn``."""
    torch.set_num_threads(num_threads)
    if mode == "raw":
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind("tcp://127.0.0.1:0")
        _send(conn, endpoint=pull.getsockopt_string(zmq.LAST_ENDPOINT))
        while (cmd := _recv(conn))["op"] == "go":
            cpu = time.process_time()
            for _ in range(cmd["num_messages"]):
                pull.recv(copy=False)
            _send(conn, t_end=time.perf_counter(), cpu_s=time.process_time() - cpu)
        pull.close(linger=0)
        ctx.term()
        return
    from kv_transfer import KVReceiver, allocate_shared_kv_cache, kv_layout

    if mode == "shm":
        kv_cache = allocate_shared_kv_cache(shape, TORCH_DTYPES[dtype], f"bench-{os.getpid()}")
    else:
        kv_cache = torch.zeros(shape, dtype=TORCH_DTYPES[dtype])
    receiver = KVReceiver(kv_cache, kv_layout(kv_cache, "bench", transport=mode), "tcp://127.0.0.1:0")
    try:
        _send(conn, endpoint=receiver.endpoint)
        while (cmd := _recv(conn))["op"] == "expect":
            receiver.expect(cmd["request_id"], cmd["dst_block_ids"], cmd["num_bytes"])
            _send(conn, ready=True)
            cpu = time.process_time()
            done = []
            while not done:
                done = receiver.poll()
                if not done:
                    time.sleep(0.0005)
            _send(conn, t_end=time.perf_counter(), cpu_s=time.process_time() - cpu, ok=done[0].ok,
                  error=done[0].error)
        stats = receiver.stats().transports.get(mode)
        _send(conn, busy_seconds=stats.busy_seconds if stats else 0.0)
    finally:
        receiver.close()


def _start_decode_side(mode: str, shape, dtype: str):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=decode_side, args=(child, mode, list(shape), dtype, torch.get_num_threads()),
                       daemon=True)
    proc.start()
    return proc, parent, _recv(parent)["endpoint"]


class TransportRun:
    """P's side of one transport: each ``run()`` ships one request to a fresh D-side reservation."""

    def __init__(self, mode: str, src: torch.Tensor, num_blocks: int, piece_bytes: int) -> None:
        from kv_transfer import KVSender, kv_layout

        self.mode, self.src, self.num_blocks = mode, src, num_blocks
        self.proc, self.conn, self.endpoint = _start_decode_side(mode, src.shape, str(src.dtype).removeprefix("torch."))
        self.sender = KVSender(src, kv_layout(src, "bench", transport=mode), max_piece_bytes=piece_bytes)
        self.num_bytes = self.sender.layout.kv_bytes(num_blocks)
        self.gen = torch.Generator().manual_seed(0)
        self.count = 0

    def run(self) -> tuple[float, float]:
        self.count += 1
        rid = f"r{self.count}"
        src_ids = torch.randperm(self.src.shape[2], generator=self.gen)[: self.num_blocks].tolist()
        dst_ids = torch.randperm(self.src.shape[2], generator=self.gen)[: self.num_blocks].tolist()
        _send(self.conn, op="expect", request_id=rid, dst_block_ids=dst_ids, num_bytes=self.num_bytes)
        _recv(self.conn)
        t0, cpu = time.perf_counter(), time.process_time()
        self.sender.send_blocks(rid, self.endpoint, src_ids, dst_ids)
        self.sender.finish(rid, b"done")
        result = _recv(self.conn)
        cpu = time.process_time() - cpu + result["cpu_s"]
        if not result["ok"]:
            raise RuntimeError(f"{self.mode} transfer failed: {result['error']}")
        while not self.sender.poll():
            time.sleep(0.0002)
        return result["t_end"] - t0, cpu

    def close(self) -> dict:
        _send(self.conn, op="stop")
        receiver_busy = _recv(self.conn)["busy_seconds"]
        sender_busy = self.sender.stats().transports[self.mode].busy_seconds
        self.sender.close()
        self.proc.join(10)
        return {"sender_busy_s_per_run": sender_busy / self.count, "receiver_busy_s_per_run": receiver_busy / self.count}


class RawZmqRun:
    """Baseline: the same bytes as zero-copy PUSH frames of ``message_bytes`` to a bare PULL in D."""

    def __init__(self, buffer: torch.Tensor, message_bytes: int) -> None:
        self.proc, self.conn, endpoint = _start_decode_side("raw", [], "")
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(endpoint)
        self.frames = [f.numpy() for f in buffer.view(-1).view(torch.uint8).split(message_bytes)]

    def run(self) -> tuple[float, float]:
        _send(self.conn, op="go", num_messages=len(self.frames))
        t0, cpu = time.perf_counter(), time.process_time()
        for frame in self.frames:
            self.push.send(frame, copy=False)
        result = _recv(self.conn)
        return result["t_end"] - t0, time.process_time() - cpu + result["cpu_s"]

    def close(self) -> dict:
        _send(self.conn, op="stop")
        self.push.close(linger=0)
        self.ctx.term()
        self.proc.join(10)
        return {}


class MemcpyRun:
    """Baseline: ``copy_`` of the same bytes between two warm buffers."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.src, self.dst = buffer, torch.empty_like(buffer)
        self.dst.copy_(buffer)  # fault the pages in

    def run(self) -> tuple[float, float]:
        t0, cpu = time.perf_counter(), time.thread_time()
        self.dst.copy_(self.src)
        return time.perf_counter() - t0, time.thread_time() - cpu

    def close(self) -> dict:
        return {}


def measure(runs: dict, repeats: int, num_bytes: int) -> dict:
    """Round-robin over ``runs`` so every variant sees the same machine load; one warm-up round.

    Wall time is what the targets use; CPU time (both processes, all threads) shows the cost per byte
    independently of how busy the machine is."""
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    try:
        for round_index in range(repeats + 1):
            for name, run in runs.items():
                elapsed, cpu_s = run.run()
                if round_index:
                    seconds[name].append(elapsed)
                    cpu[name].append(cpu_s)
    finally:
        extras = {name: run.close() for name, run in runs.items()}
    return {
        name: {"median_s": statistics.median(s), "gb_per_s": num_bytes / statistics.median(s) / 1e9,
               "median_cpu_s": statistics.median(cpu[name]), "runs_s": s, **extras[name]}
        for name, s in seconds.items()
    }


def plot(report: dict, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: plot skipped (pip install matplotlib)"
    names = ["zmq", "raw zmq (tcp)", "shm", "torch copy_"]
    values = [report["zmq"]["gb_per_s"], report["raw_zmq_gb_per_s"], report["shm"]["gb_per_s"],
              report["memcpy"]["gb_per_s"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, values, color=["tab:blue", "tab:gray", "tab:orange", "tab:gray"])
    ax.set_ylabel("GB/s")
    ax.set_title(f"KV transfer, {report['config']['total_mib']} MiB per request (median)")
    fig.tight_layout()
    fig.savefig(path)
    return f"plot written to {path}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=64, help="blocks in the request")
    parser.add_argument("--pool-blocks", type=int, default=96, help="blocks in each cache")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=list(TORCH_DTYPES), default="float16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--piece-mib", type=float, default=MAX_PIECE_BYTES / 2**20, help="KVSender max_piece_bytes")
    parser.add_argument("--torch-threads", type=int, default=1, help="in P and D (and for the copy_ baseline)")
    parser.add_argument("--out", help="write the JSON report here")
    parser.add_argument("--plot", help="write a bar chart here (needs matplotlib)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.torch_threads)
    shape = (args.layers, 2, args.pool_blocks, args.page_size, args.kv_heads, args.head_dim)
    src = torch.randn(shape).to(TORCH_DTYPES[args.dtype])
    request = src[:, :, : args.blocks].contiguous()  # same bytes as one request, as one buffer
    total = request.numel() * request.element_size()
    piece_bytes = int(args.piece_mib * 2**20)
    runs = {
        "raw_zmq_single": RawZmqRun(request, total),
        "raw_zmq_pieces": RawZmqRun(request, piece_bytes),
        "memcpy": MemcpyRun(request),
        "zmq": TransportRun("zmq", src, args.blocks, piece_bytes),
        "shm": TransportRun("shm", src, args.blocks, piece_bytes),
    }
    report: dict = {
        "config": {**vars(args), "total_mib": total / 2**20,
                   "host": platform.node(), "cpus": os.cpu_count(), "load_avg_before": os.getloadavg(),
                   "torch": torch.__version__, "pyzmq": zmq.__version__},
        **measure(runs, args.repeats, total),
    }
    report["config"]["load_avg_after"] = os.getloadavg()
    report["raw_zmq_gb_per_s"] = max(report["raw_zmq_single"]["gb_per_s"], report["raw_zmq_pieces"]["gb_per_s"])
    report["ratios"] = {
        "zmq_vs_raw_zmq": report["zmq"]["gb_per_s"] / report["raw_zmq_gb_per_s"],
        "shm_vs_memcpy": report["shm"]["gb_per_s"] / report["memcpy"]["gb_per_s"],
    }
    report["targets_met"] = {
        "zmq": report["ratios"]["zmq_vs_raw_zmq"] >= TARGETS["zmq"],
        "shm": report["ratios"]["shm_vs_memcpy"] >= TARGETS["shm"],
    }
    for name, key in (("zmq (tcp loopback)", "zmq"), ("raw zmq, one message", "raw_zmq_single"),
                      ("raw zmq, piece-size msgs", "raw_zmq_pieces"), ("shm", "shm"), ("torch copy_", "memcpy")):
        r = report[key]
        print(f"{name:26s} {r['gb_per_s']:6.2f} GB/s  (median {r['median_s'] * 1e3:6.1f} ms wall, "
              f"{r['median_cpu_s'] * 1e3:6.1f} ms CPU)")
    print(f"zmq / raw zmq = {report['ratios']['zmq_vs_raw_zmq']:.2f} (target >= {TARGETS['zmq']}), "
          f"shm / copy_ = {report['ratios']['shm_vs_memcpy']:.2f} (target >= {TARGETS['shm']})")
    if args.plot:
        report["plot"] = plot(report, args.plot)
        print(report["plot"])
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
