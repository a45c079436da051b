"""The cuda_ipc KV transport between two real processes on a GPU (``pytest -m gpu tests/gpu``; run by
``make gpu-check``). The receiver (``bench.gpu_check_numbers kv-receiver``) holds a CUDA cache in a child process;
this process sends into it over CUDA IPC. Every transfer is checksummed end to end (the receiver sums what sits
in its cache after the sender's in-place writes), so ``ok`` means the bytes are exactly the sender's. Skipped
without CUDA; the protocol itself runs on the CPU in tests/kv_transfer ("cuda_ipc-emulated")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO_ROOT = Path(__file__).resolve().parents[2]
SHAPE = [4, 2, 64, 16, 2, 64]  # [layers, 2, blocks, page, kv heads, head dim]


def _transfer(src_device: str, dst_device: str, dtype: torch.dtype) -> None:
    from bench.transfer_bench import Channel
    from kv_transfer import KVSender, kv_layout

    src = torch.randn(SHAPE, device=src_device).to(dtype)
    sender = KVSender(src, kv_layout(src, "gpu-check", transport="cuda_ipc"), kernel_backend="auto")
    proc = subprocess.Popen([sys.executable, "-m", "bench.gpu_check_numbers", "kv-receiver", dst_device,
                             str(dtype)[6:], ",".join(map(str, SHAPE)), "cuda_ipc"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO_ROOT)
    conn = Channel(proc.stdout, proc.stdin)
    try:
        endpoint = conn.recv()["endpoint"]
        for i, (src_ids, dst_ids) in enumerate([(list(range(8)), list(range(40, 48))),
                                                ([63, 1, 30, 2], [0, 17, 5, 63])]):
            num_bytes = sender.layout.kv_bytes(len(dst_ids))
            conn.send(op="expect", request_id=f"r{i}", dst_block_ids=dst_ids, num_bytes=num_bytes)
            conn.recv()
            sender.send_blocks(f"r{i}", endpoint, src_ids[:2], dst_ids[:2], layers=slice(0, 1))  # a layer first
            sender.send_blocks(f"r{i}", endpoint, src_ids[:2], dst_ids[:2], layers=slice(1, None))
            sender.send_blocks(f"r{i}", endpoint, src_ids[2:], dst_ids[2:])
            sender.finish(f"r{i}", b"done")
            reply = conn.recv()
            assert reply["ok"], reply["error"]
            assert reply["transport"] == "cuda_ipc"
            (status,) = sender.poll(timeout_s=10.0) or sender.poll(timeout_s=10.0)
            assert status.ok and status.transport == "cuda_ipc" and status.num_bytes == num_bytes
        assert sender.stats().num_transport_fallbacks == 0
        conn.send(op="stop")
        assert proc.wait(30) == 0
    finally:
        sender.close()
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_lands_exactly_over_cuda_ipc_on_one_gpu(dtype):
    _transfer("cuda:0", "cuda:0", dtype)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_kv_lands_exactly_over_cuda_ipc_across_two_gpus():
    _transfer("cuda:0", "cuda:1", torch.bfloat16)
