"""KV transfer throughput per transport, against raw baselines measured in the same run.

P (this process) ships one request of ``--blocks`` whole blocks (64 MiB with the defaults: 16 layers x
K/V x 64 blocks x 16 tokens x 8 heads x 128 dims in fp16, random source and destination block ids) to D,
a separate process, and the clock runs from the first ``send_blocks`` on P to the moment ``poll()`` on D
returns the verified transfer. Baselines, same bytes, same process layout: raw ZMQ PUSH/PULL over tcp
loopback (zero-copy frames, at each ``--raw-mib`` message size; the fastest is the reference) for the zmq
transport, and one copy between two warm buffers (torch ``copy_`` and libc ``memcpy``; the faster is the
reference) for shm; ``memcpy_pages`` (one memcpy per run of the random blocks, cache to cache: what the
shm transport copies, no more) is shown for reference. Variants run round-robin so they share the
machine's load; the report has medians of ``--repeats`` runs, the ratios, the load average and, per
variant, the CPU time and run-queue wait of every busy thread of P and D (Linux schedstat).

    python -m bench.transfer_bench --repeats 15 --out bench/results/transfer_bench.json
    python -m bench.plot bench/results/transfer_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

import msgspec
import numpy
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


def block_ids(gen: torch.Generator, num_blocks: int, n: int) -> list[int]:
    """``n`` distinct random block ids of a cache of ``num_blocks``."""
    return torch.randperm(num_blocks, generator=gen)[:n].tolist()


def decode_side(conn: Channel, mode: str, shape: list[int], dtype: str, num_threads: int) -> None:
    """D: a KVReceiver (zmq / shm) or a bare PULL socket (raw), driven over ``conn``; waits block, never spin."""
    torch.set_num_threads(num_threads)
    if mode == "raw":
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind("tcp://127.0.0.1:0")
        conn.send(endpoint=pull.getsockopt_string(zmq.LAST_ENDPOINT), tid=threading.get_native_id())
        while (cmd := conn.recv())["op"] == "go":
            for _ in range(cmd["num_messages"]):
                pull.recv(copy=False)
            conn.send(t_end=time.perf_counter())
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
        conn.send(endpoint=receiver.endpoint, tid=receiver._thread.native_id)
        while (cmd := conn.recv())["op"] == "expect":
            receiver.expect(cmd["request_id"], cmd["dst_block_ids"], cmd["num_bytes"])
            conn.send(ready=True)
            done = []
            while not done:
                done = receiver.poll(timeout_s=10.0)
            conn.send(t_end=time.perf_counter(), ok=done[0].ok, error=done[0].error)
    finally:
        receiver.close()


def _start_decode_side(mode: str, shape, dtype: str):
    command = [sys.executable, "-m", "bench.transfer_bench", "--decode-side", mode, "--shape",
               ",".join(map(str, shape)), "--dtype", dtype, "--torch-threads", str(torch.get_num_threads())]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO_ROOT)
    conn = Channel(proc.stdout, proc.stdin)
    hello = conn.recv()
    return proc, conn, hello["endpoint"], hello["tid"]


class TransportRun:
    """P's side of one transport: each ``run()`` ships one request to a fresh D-side reservation."""

    def __init__(self, mode: str, src: torch.Tensor, num_blocks: int, piece_bytes: int) -> None:
        from kv_transfer import KVSender, kv_layout

        self.mode, self.src, self.num_blocks = mode, src, num_blocks
        self.proc, self.conn, self.endpoint, d_tid = _start_decode_side(mode, src.shape, str(src.dtype)[6:])
        self.sender = KVSender(src, kv_layout(src, "bench", transport=mode), max_piece_bytes=piece_bytes,
                               num_torch_threads=torch.get_num_threads())
        self.labels = {self.sender._thread.native_id: "P kv-sender", d_tid: "D kv-receiver"}
        self.num_bytes = self.sender.layout.kv_bytes(num_blocks)
        self.gen = torch.Generator().manual_seed(0)
        self.count = 0

    def run(self) -> float:
        self.count += 1
        rid = f"r{self.count}"
        src_ids, dst_ids = (block_ids(self.gen, self.src.shape[2], self.num_blocks) for _ in "sd")
        self.conn.send(op="expect", request_id=rid, dst_block_ids=dst_ids, num_bytes=self.num_bytes)
        self.conn.recv()
        t0 = time.perf_counter()
        self.sender.send_blocks(rid, self.endpoint, src_ids, dst_ids)
        self.sender.finish(rid, b"done")
        result = self.conn.recv()
        if not result["ok"]:
            raise RuntimeError(f"{self.mode} transfer failed: {result['error']}")
        while not self.sender.poll(timeout_s=10.0):
            pass
        return result["t_end"] - t0

    def close(self) -> None:
        self.conn.send(op="stop")
        self.sender.close()
        self.proc.wait(10)


class RawZmqRun:
    """Baseline: the same bytes as zero-copy PUSH frames of ``message_bytes`` to a bare PULL in D."""

    def __init__(self, buffer: torch.Tensor, message_bytes: int) -> None:
        self.proc, self.conn, endpoint, d_tid = _start_decode_side("raw", [], "float16")  # shape, dtype unused
        self.labels = {d_tid: "D main (recv)"}
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(endpoint)
        self.frames = [f.numpy() for f in buffer.view(-1).view(torch.uint8).split(message_bytes)]

    def run(self) -> float:
        self.conn.send(op="go", num_messages=len(self.frames))
        t0 = time.perf_counter()
        for frame in self.frames:
            self.push.send(frame, copy=False)
        return self.conn.recv()["t_end"] - t0

    def close(self) -> None:
        self.conn.send(op="stop")
        self.push.close(linger=0)
        self.ctx.term()
        self.proc.wait(10)


class MemcpyRun:
    """Baseline: the same bytes copied between two warm buffers, by torch ``copy_``, by libc ``memcpy``
    (what ``numpy.copyto`` calls for contiguous bytes), or (``"pages"``, for reference only) by one memcpy
    per run of the request's random blocks from cache to cache: what the shm transport copies, no more."""

    def __init__(self, src: torch.Tensor, num_blocks: int, method: str) -> None:
        from kv_transfer.blocks import paired_runs
        from kv_transfer.data_path import byte_pages

        buffer = src[:, :, :num_blocks].contiguous()  # the request's bytes as one buffer
        self.src, self.dst = (src, src.clone()) if method == "pages" else (buffer, buffer.clone())
        src_pages, dst_pages, gen = byte_pages(self.src), byte_pages(self.dst), torch.Generator().manual_seed(1)

        def copy_pages() -> None:
            src_ids, dst_ids = (block_ids(gen, src.shape[2], num_blocks) for _ in "sd")
            for s, d, n in paired_runs(src_ids, dst_ids):
                numpy.copyto(dst_pages[:, :, d : d + n], src_pages[:, :, s : s + n])

        self.copy = {"copy_": lambda: self.dst.copy_(self.src), "memcpy": lambda: numpy.copyto(dst_pages, src_pages),
                     "pages": copy_pages}[method]
        self.proc, self.labels = None, {threading.get_native_id(): f"P main ({method})"}

    def run(self) -> float:
        t0 = time.perf_counter()
        self.copy()
        return time.perf_counter() - t0

    def close(self) -> None:
        pass


def thread_times(pids: list[int]) -> dict[tuple[int, int], tuple[str, int, int]]:
    """``(pid, tid) -> (comm, ns on CPU, ns waiting for a CPU)`` for every thread of ``pids`` (Linux)."""
    out = {}
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    comm = f.read().strip()
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    on_cpu, waiting = map(int, f.read().split()[:2])
            except OSError:
                continue
            out[(pid, int(tid))] = (comm, on_cpu, waiting)
    return out


def cpu_steal_share() -> tuple[int, int] | None:
    """``(steal ticks, all ticks)`` from /proc/stat: time the hypervisor gave this VM's CPUs to others."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)


def measure(runs: dict, repeats: int, num_bytes: int) -> dict:
    """Round-robin over ``runs`` so every variant sees the same machine load; one warm-up round.

    Wall time is what the targets use; per-thread CPU (both processes) shows where the time goes."""
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    threads: dict[str, dict[str, list[float]]] = {name: {} for name in runs}
    try:
        for round_index in range(repeats + 1):
            for name, run in runs.items():
                pids = [os.getpid()] + ([run.proc.pid] if run.proc else [])
                before = thread_times(pids)
                elapsed = run.run()
                after = thread_times(pids)
                if not round_index:
                    continue
                seconds[name].append(elapsed)
                for key, (comm, on_cpu, waiting) in after.items():
                    if key in before:
                        side = "P" if key[0] == os.getpid() else "D"
                        label = run.labels.get(key[1]) or (f"{side} main" if key[0] == key[1] else f"{side} {comm}")
                        cpu, wait = threads[name].setdefault(label, [0.0, 0.0])
                        threads[name][label] = [cpu + (on_cpu - before[key][1]) / 1e6 / repeats,
                                                wait + (waiting - before[key][2]) / 1e6 / repeats]
    finally:
        for run in runs.values():
            run.close()
    return {
        name: {"median_s": statistics.median(s), "gb_per_s": num_bytes / statistics.median(s) / 1e9, "runs_s": s,
               "threads_ms_per_run": {label: {"cpu": round(cpu, 2), "runq_wait": round(wait, 2)}
                                      for label, (cpu, wait) in threads[name].items() if cpu + wait >= 0.2}}
        for name, s in seconds.items()
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=64, help="blocks in the request")
    parser.add_argument("--pool-blocks", type=int, default=96, help="blocks in each cache")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=list(TORCH_DTYPES), default="float16")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--piece-mib", type=float, default=MAX_PIECE_BYTES / 2**20, help="KVSender max_piece_bytes")
    parser.add_argument("--raw-mib", default="0.25,1,4,16,0", help="raw ZMQ message sizes in MiB (0: one message)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="intra-op threads of the transfer threads and of the copy_ baseline")
    parser.add_argument("--out", help="write the JSON report here")
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
    raw_sizes = {f"raw_zmq_{mib:g}mib" if mib else "raw_zmq_single": int(mib * 2**20) or total
                 for mib in map(float, args.raw_mib.split(","))}
    runs = {name: RawZmqRun(request, size) for name, size in raw_sizes.items()}
    runs["memcpy_libc"] = MemcpyRun(src, args.blocks, "memcpy")
    runs["memcpy_torch"] = MemcpyRun(src, args.blocks, "copy_")
    runs["memcpy_pages"] = MemcpyRun(src, args.blocks, "pages")
    for mode in ("zmq", "shm"):
        runs[mode] = TransportRun(mode, src, args.blocks, int(args.piece_mib * 2**20))
    report: dict = {
        "benchmark": "transfer",
        "targets": TARGETS,
        "config": {**vars(args), "total_mib": total / 2**20, "host": platform.node(), "cpus": os.cpu_count(),
                   "load_avg_before": os.getloadavg(), "torch": torch.__version__, "pyzmq": zmq.__version__},
    }
    steal_before = cpu_steal_share()
    report.update(measure(runs, args.repeats, total))
    steal_after = cpu_steal_share()
    report["config"]["load_avg_after"] = os.getloadavg()
    if steal_before and steal_after and steal_after[1] > steal_before[1]:
        report["config"]["cpu_steal_pct"] = 100 * (steal_after[0] - steal_before[0]) / (steal_after[1] - steal_before[1])
    report["raw_zmq_best"] = max(raw_sizes, key=lambda name: report[name]["gb_per_s"])
    report["raw_zmq_gb_per_s"] = report[report["raw_zmq_best"]]["gb_per_s"]
    report["memcpy_best"] = max(("memcpy_libc", "memcpy_torch"), key=lambda name: report[name]["gb_per_s"])
    report["memcpy_gb_per_s"] = report[report["memcpy_best"]]["gb_per_s"]
    report["ratios"] = {"zmq_vs_raw_zmq": report["zmq"]["gb_per_s"] / report["raw_zmq_gb_per_s"],
                        "shm_vs_memcpy": report["shm"]["gb_per_s"] / report["memcpy_gb_per_s"],
                        "shm_vs_memcpy_pages": report["shm"]["gb_per_s"] / report["memcpy_pages"]["gb_per_s"]}
    report["targets_met"] = {"zmq": report["ratios"]["zmq_vs_raw_zmq"] >= TARGETS["zmq"],
                             "shm": report["ratios"]["shm_vs_memcpy"] >= TARGETS["shm"]}
    for name in runs:
        r = report[name]
        busy = ", ".join(f"{label} {t['cpu']:.1f}" for label, t in r["threads_ms_per_run"].items())
        print(f"{name:16s} {r['gb_per_s']:6.2f} GB/s  median {r['median_s'] * 1e3:6.1f} ms  CPU ms/run: {busy}")
    ratios, load = report["ratios"], report["config"]
    print(f"zmq / raw zmq ({report['raw_zmq_best']}) = {ratios['zmq_vs_raw_zmq']:.2f} (target >= {TARGETS['zmq']}), "
          f"shm / memcpy ({report['memcpy_best']}) = {ratios['shm_vs_memcpy']:.2f} (target >= {TARGETS['shm']}; "
          f"vs memcpy_pages {ratios['shm_vs_memcpy_pages']:.2f}), load average {load['load_avg_before'][0]:.2f} -> "
          f"{load['load_avg_after'][0]:.2f}, CPU steal {load.get('cpu_steal_pct', float('nan')):.1f}%")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
