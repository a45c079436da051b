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
import os
import platform
import statistics
import subprocess
import sys
import time

import msgspec
import torch
import zmq

from kv_transfer.blocks import MAX_PIECE_BYTES

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
TARGETS = {"zmq": 0.7, "shm": 0.5}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Channel:
    """Control messages between P (this process) and D (a child process): JSON lines over its stdin/stdout."""

    def __init__(self, reader, writer) -> None:
        self.reader, self.writer = reader, writer

    def send(self, **msg) -> None:
        self.writer.write(msgspec.json.encode(msg) + b"\n")
        self.writer.flush()

    def recv(self) -> dict:
        line = self.reader.readline()
        if not line:
            raise RuntimeError("the decode-side process exited (see its stderr above)")
        return msgspec.json.decode(line)


def decode_side(conn: Channel, mode: str, shape: list[int], dtype: str, num_threads: int) -> None:
    """D: a KVReceiver (zmq / shm) or a bare PULL socket (raw), driven over ``conn``."""
    torch.set_num_threads(num_threads)
    if mode == "raw":
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind("tcp://127.0.0.1:0")
        conn.send(endpoint=pull.getsockopt_string(zmq.LAST_ENDPOINT))
        while (cmd := conn.recv())["op"] == "go":
            cpu = time.process_time()
            for _ in range(cmd["num_messages"]):
                pull.recv(copy=False)
            conn.send(t_end=time.perf_counter(), cpu_s=time.process_time() - cpu)
        pull.close(linger=0)
        ctx.term()
        return
    from kv_transfer import KVReceiver, allocate_shared_kv_cache, kv_layout

    if mode == "shm":
        kv_cache = allocate_shared_kv_cache(shape, TORCH_DTYPES[dtype], f"bench-{os.getpid()}")
    else:
        kv_cache = torch.zeros(shape, dtype=TORCH_DTYPES[dtype])
    receiver = KVReceiver(kv_cache, kv_layout(kv_cache, "bench", transport=mode), "tcp://127.0.0.1:0",
                          num_torch_threads=num_threads)
    try:
        conn.send(endpoint=receiver.endpoint)
        while (cmd := conn.recv())["op"] == "expect":
            receiver.expect(cmd["request_id"], cmd["dst_block_ids"], cmd["num_bytes"])
            conn.send(ready=True)
            cpu = time.process_time()
            done = []
            while not done:
                done = receiver.poll()
                if not done:
                    time.sleep(0.0005)
            conn.send(t_end=time.perf_counter(), cpu_s=time.process_time() - cpu, ok=done[0].ok,
                  error=done[0].error)
        stats = receiver.stats().transports.get(mode)
        conn.send(busy_seconds=stats.busy_seconds if stats else 0.0)
    finally:
        receiver.close()


def _start_decode_side(mode: str, shape, dtype: str):
    command = [sys.executable, "-m", "bench.transfer_bench", "--decode-side", mode, "--shape",
               ",".join(map(str, shape)), "--dtype", dtype, "--torch-threads", str(torch.get_num_threads())]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO_ROOT)
    conn = Channel(proc.stdout, proc.stdin)
    return proc, conn, conn.recv()["endpoint"]


class TransportRun:
    """P's side of one transport: each ``run()`` ships one request to a fresh D-side reservation."""

    def __init__(self, mode: str, src: torch.Tensor, num_blocks: int, piece_bytes: int) -> None:
        from kv_transfer import KVSender, kv_layout

        self.mode, self.src, self.num_blocks = mode, src, num_blocks
        self.proc, self.conn, self.endpoint = _start_decode_side(mode, src.shape, str(src.dtype).removeprefix("torch."))
        self.sender = KVSender(src, kv_layout(src, "bench", transport=mode), max_piece_bytes=piece_bytes,
                               num_torch_threads=torch.get_num_threads())
        self.num_bytes = self.sender.layout.kv_bytes(num_blocks)
        self.gen = torch.Generator().manual_seed(0)
        self.count = 0

    def run(self) -> tuple[float, float]:
        self.count += 1
        rid = f"r{self.count}"
        src_ids = torch.randperm(self.src.shape[2], generator=self.gen)[: self.num_blocks].tolist()
        dst_ids = torch.randperm(self.src.shape[2], generator=self.gen)[: self.num_blocks].tolist()
        self.conn.send(op="expect", request_id=rid, dst_block_ids=dst_ids, num_bytes=self.num_bytes)
        self.conn.recv()
        t0, cpu = time.perf_counter(), time.process_time()
        self.sender.send_blocks(rid, self.endpoint, src_ids, dst_ids)
        self.sender.finish(rid, b"done")
        result = self.conn.recv()
        cpu = time.process_time() - cpu + result["cpu_s"]
        if not result["ok"]:
            raise RuntimeError(f"{self.mode} transfer failed: {result['error']}")
        while not self.sender.poll():
            time.sleep(0.0002)
        return result["t_end"] - t0, cpu

    def close(self) -> dict:
        self.conn.send(op="stop")
        receiver_busy = self.conn.recv()["busy_seconds"]
        sender_busy = self.sender.stats().transports[self.mode].busy_seconds
        self.sender.close()
        self.proc.wait(10)
        return {"sender_busy_s_per_run": sender_busy / self.count, "receiver_busy_s_per_run": receiver_busy / self.count}


class RawZmqRun:
    """Baseline: the same bytes as zero-copy PUSH frames of ``message_bytes`` to a bare PULL in D."""

    def __init__(self, buffer: torch.Tensor, message_bytes: int) -> None:
        self.proc, self.conn, endpoint = _start_decode_side("raw", [], "float16")  # shape and dtype unused
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(endpoint)
        self.frames = [f.numpy() for f in buffer.view(-1).view(torch.uint8).split(message_bytes)]

    def run(self) -> tuple[float, float]:
        self.conn.send(op="go", num_messages=len(self.frames))
        t0, cpu = time.perf_counter(), time.process_time()
        for frame in self.frames:
            self.push.send(frame, copy=False)
        result = self.conn.recv()
        return result["t_end"] - t0, time.process_time() - cpu + result["cpu_s"]

    def close(self) -> dict:
        self.conn.send(op="stop")
        self.push.close(linger=0)
        self.ctx.term()
        self.proc.wait(10)
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
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="intra-op threads of the transfer threads and of the copy_ baseline")
    parser.add_argument("--out", help="write the JSON report here")
    parser.add_argument("--plot", help="write a bar chart here (needs matplotlib)")
    parser.add_argument("--decode-side", choices=["raw", "zmq", "shm"], help=argparse.SUPPRESS)
    parser.add_argument("--shape", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.decode_side:  # the child process
        shape = [int(x) for x in args.shape.split(",") if x]
        decode_side(Channel(sys.stdin.buffer, sys.stdout.buffer), args.decode_side, shape, args.dtype,
                    args.torch_threads)
        return {}

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
