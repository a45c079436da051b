"""gpu-check's numbers, one stage per subcommand (measured, never asserted beyond "it ran and was right"):

- ``kernels``: the two ceilings measured first (a device-to-device copy, an 8192^3 bf16 matmul), then the
  triton paged attention on ``bench.kernel_bench``'s decode and prefill shapes (GB/s against the measured
  copy and the datasheet HBM peak) and the prefill GEMMs of the 1.1B shape at 8192 tokens (TFLOP/s against
  the measured matmul and the datasheet bf16 peak);
- ``kv-transfer``: one request's KV (the 1.1B shape, 512 blocks of 16 tokens) from a ``KVSender`` here to a
  ``KVReceiver`` in another process, both caches on the device, over the transport a CUDA cache gets
  ("zmq": packed on the device, through host memory, unpacked on the device), GB/s;
- ``offline``: the offline ``LLM``'s tok/s on the TinyLlama-1.1B shape (22 layers, hidden 2048, MLP 5632,
  32 heads, 4 KV heads, vocabulary 32000; random bf16 weights built here) against transformers ``generate``
  on the same GPU and prompts (one left-padded batch).

``--dry-run``: the same code on the CPU with tiny shapes and fp32, the CPU kernel set in the triton set's place
(numbers meaningless).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import subprocess
import sys
import time

import torch

from bench.gpu_check import REPO_ROOT, stage_main

# Datasheet leads for the SXM parts (H200.md): dense bf16 ~990 TFLOP/s; HBM 3.35 TB/s (H100), 4.8 TB/s (H200)
DATASHEET = {"H100": {"hbm_gbps": 3350.0, "bf16_tflops": 989.0}, "H200": {"hbm_gbps": 4800.0, "bf16_tflops": 989.0}}
TINYLLAMA = dict(num_hidden_layers=22, hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)


def datasheet(device: str) -> dict:
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    return next((v for k, v in DATASHEET.items() if k in name), {"hbm_gbps": None, "bf16_tflops": None})


def timer(device: str):
    """fn -> median milliseconds: triton's do_bench (CUDA events) on the GPU, perf_counter on the CPU."""
    if device.startswith("cuda"):
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, return_mode="median")

    def cpu_ms(fn, repeats: int = 3) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return cpu_ms


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- kernels
def kernels_stage(args) -> dict:
    from bench.kernel_bench import Case, _paged_batch, attention_cases
    from kernels import TORCH_KERNELS, load_kernels

    device, on_gpu = args.device, args.device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    ms = timer(device)
    torch.manual_seed(0)
    peaks = datasheet(device)
    copy_numel = (2**30 if on_gpu else 2**22) // 2  # 1 GiB (GPU) of bf16
    src = torch.randn(copy_numel, device=device).to(dtype)
    dst = torch.empty_like(src)
    copy_gbps = 2 * src.numel() * src.element_size() / ms(lambda: dst.copy_(src)) / 1e6
    n = 8192 if on_gpu else 256
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    matmul_tflops = 2 * n**3 / ms(lambda: a @ b) / 1e9
    src = dst = a = b = None  # the ceilings' buffers (over 2 GiB) freed first
    result = {"device": device, "dtype": str(dtype)[6:], "datasheet": peaks,
              "measured_copy_gbps": round(copy_gbps, 1), "matmul_size": n,
              "measured_matmul_tflops": round(matmul_tflops, 1)}

    kernel_set = load_kernels("triton" if on_gpu else "cpu", device)
    if on_gpu:
        cases = attention_cases(kernel_set, TORCH_KERNELS, dtype)
    else:  # one tiny decode batch: the CPU kernel set against the reference, as the GPU run checks triton's
        batch = _paged_batch(4, 1, 64, 4, 2, 32, 16, dtype, device=device)

        def ours():
            return kernel_set.paged_attention(*batch, 0.2)

        def reference():
            return TORCH_KERNELS.paged_attention(*batch, 0.2)

        kv_bytes, qo_bytes = 2 * 4 * 64 * 2 * 32 * 4, 2 * 4 * 4 * 32 * 4  # fp32: K/V of 4 x 64 tokens, q and out
        cases = [Case("paged_attention", "decode b4 ctx64 (dry run)", ours, reference, kv_bytes + qo_bytes,
                      flops=4 * 4 * 64 * 4 * 32)]
    attention = []
    for case in cases:
        ours, ref = case.run_triton().float(), case.run_torch().float()
        err = float((ours - ref).norm() / ref.norm())  # relative; bf16 operands land between 1e-3 and 1e-2
        t = ms(case.run_triton)
        gbps = case.num_bytes / t / 1e6
        attention.append({"case": case.name, "ms": round(t, 4), "gbps": round(gbps, 1),
                          "pct_of_measured_copy": round(100 * gbps / copy_gbps, 1),
                          "pct_of_datasheet_hbm": (round(100 * gbps / peaks["hbm_gbps"], 1) if peaks["hbm_gbps"]
                                                   else None),
                          "tflops": round(case.flops / t / 1e9, 1), "rel_err_vs_reference": err})
        print(attention[-1], flush=True)
    result["paged_attention"] = attention

    tokens, hidden, inter = (8192, 2048, 5632) if on_gpu else (64, 64, 128)
    head_dim = 64 if on_gpu else 16
    q_kv = hidden + 2 * 4 * head_dim
    gemms = []
    for name, n_out, k_in in (("qkv", q_kv, hidden), ("o", hidden, hidden), ("gate_up", 2 * inter, hidden),
                              ("down", hidden, inter)):
        x = torch.randn(tokens, k_in, device=device, dtype=dtype)
        w = torch.randn(n_out, k_in, device=device, dtype=dtype) * k_in**-0.5
        t = ms(lambda: torch.nn.functional.linear(x, w))
        tflops = 2 * tokens * n_out * k_in / t / 1e9
        gemms.append({"gemm": f"{name} [{tokens}x{k_in}] x [{k_in}x{n_out}]", "ms": round(t, 4),
                      "tflops": round(tflops, 1), "pct_of_measured_matmul": round(100 * tflops / matmul_tflops, 1),
                      "pct_of_datasheet_bf16": round(100 * tflops / peaks["bf16_tflops"], 1) if peaks["bf16_tflops"]
                      else None})
        print(gemms[-1], flush=True)
    result["prefill_gemms"] = gemms
    bad = [a["case"] for a in attention if not math.isfinite(a["rel_err_vs_reference"])
           or a["rel_err_vs_reference"] > (2e-2 if on_gpu else 1e-5)]
    result["ok"] = not bad
    if bad:
        result["error"] = f"paged attention far from its reference on {bad}"
    return result


# ----------------------------------------------------------------------------- kv transfer
def kv_shape(dry_run: bool, num_blocks: int) -> list[int]:
    # [layers, 2, blocks, page, kv heads, head dim]: the 1.1B shape, or a tiny one
    return [2, 2, num_blocks, 4, 2, 16] if dry_run else [22, 2, num_blocks, 16, 4, 64]


def kv_receiver(argv: list[str]) -> int:
    """The decode side, a child process: a KVReceiver on a device cache, accepting ``transport``, driven over
    stdin/stdout."""
    from bench.transfer_bench import Channel
    from kv_transfer import KVReceiver, kv_layout

    device, dtype, shape, transport = argv[0], getattr(torch, argv[1]), [int(x) for x in argv[2].split(",")], argv[3]
    conn = Channel(sys.stdin.buffer, sys.stdout.buffer)
    kv_cache = torch.zeros(shape, dtype=dtype, device=device)
    receiver = KVReceiver(kv_cache, kv_layout(kv_cache, "gpu-check", transport=transport), "tcp://127.0.0.1:0",
                          kernel_backend="auto")
    try:
        conn.send(endpoint=receiver.endpoint)
        while (cmd := conn.recv())["op"] == "expect":
            receiver.expect(cmd["request_id"], cmd["dst_block_ids"], cmd["num_bytes"])
            conn.send(ready=True)
            done = []
            while not done:
                done = receiver.poll(timeout_s=10.0)
            sync(device)
            conn.send(t_end=time.perf_counter(), ok=done[0].ok, error=done[0].error, transport=done[0].transport)
    finally:
        receiver.close()
    return 0


def kv_transfer_stage(args) -> dict:
    """One request's KV between two processes over each transport the device has (cuda_ipc and zmq on a GPU, zmq
    on the CPU dry run): median seconds and GB/s after a warm-up; every transfer is checksummed end to end."""
    device, on_gpu = args.device, args.device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    num_blocks, pool_blocks, repeats = (512, 1024, 5) if on_gpu else (16, 32, 2)
    shape = kv_shape(not on_gpu, pool_blocks)
    src = torch.randn(shape, device=device).to(dtype)
    num_bytes = src.numel() * src.element_size() // pool_blocks * num_blocks
    result = {"device": device, "dtype": str(dtype)[6:], "cache_shape": shape, "blocks_per_transfer": num_blocks,
              "mib_per_transfer": round(num_bytes / 2**20, 1), "repeats": repeats, "by_transport": {}, "ok": True}
    for transport in ("cuda_ipc", "zmq") if on_gpu else ("zmq",):
        try:
            measured = _time_transfers(src, transport, num_blocks, pool_blocks, repeats)
        except Exception as exc:  # the other transport is still measured
            measured = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            result["ok"], result["error"] = False, f"{transport}: {measured['error']}"
        result["by_transport"][transport] = measured
        print(transport, measured, flush=True)
    host = src.reshape(-1)[: num_bytes // src.element_size()]
    start = time.perf_counter()
    host.cpu()
    result["device_to_host_copy_gbps"] = round(num_bytes / (time.perf_counter() - start) / 1e9, 2)
    return result


def _time_transfers(src: torch.Tensor, transport: str, num_blocks: int, pool_blocks: int, repeats: int) -> dict:
    from bench.transfer_bench import Channel, block_ids
    from kv_transfer import KVSender, kv_layout

    sender = KVSender(src, kv_layout(src, "gpu-check", transport=transport), kernel_backend="auto")
    proc = subprocess.Popen([sys.executable, "-m", "bench.gpu_check_numbers", "kv-receiver", str(src.device),
                             str(src.dtype)[6:], ",".join(map(str, src.shape)), transport],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO_ROOT)
    conn = Channel(proc.stdout, proc.stdin)
    gen = torch.Generator().manual_seed(0)
    num_bytes = sender.layout.kv_bytes(num_blocks)
    seconds, seen = [], set()
    try:
        endpoint = conn.recv()["endpoint"]
        for i in range(repeats + 1):  # the first one warms up (handshake, kernels' compile): not counted
            src_ids, dst_ids = block_ids(gen, pool_blocks, num_blocks), block_ids(gen, pool_blocks, num_blocks)
            conn.send(op="expect", request_id=f"r{i}", dst_block_ids=dst_ids, num_bytes=num_bytes)
            conn.recv()
            t0 = time.perf_counter()
            sender.send_blocks(f"r{i}", endpoint, src_ids, dst_ids)
            sender.finish(f"r{i}", b"done")
            reply = conn.recv()
            if not reply["ok"]:
                raise RuntimeError(f"transfer failed: {reply['error']}")
            seen.add(reply["transport"])
            while not sender.poll(timeout_s=10.0):
                pass
            if i:
                seconds.append(reply["t_end"] - t0)
        conn.send(op="stop")
        proc.wait(30)
    finally:
        fallbacks = sender.stats().num_transport_fallbacks
        sender.close()
        if proc.poll() is None:
            proc.kill()
    median = statistics.median(seconds)
    ok = seen == {transport}
    return {"transports_seen": sorted(seen), "transport_fallbacks": fallbacks, "median_s": round(median, 4),
            "gbps": round(num_bytes / median / 1e9, 3), "all_gbps": [round(num_bytes / s / 1e9, 3) for s in seconds],
            "ok": ok, **({} if ok else {"error": f"asked for {transport}, the bytes went over {sorted(seen)}"})}


# ----------------------------------------------------------------------------- offline throughput
def build_model(path, device: str, dry_run: bool):
    """A random-weight Llama checkpoint at ``path`` (the 1.1B shape in bf16, or tiny in fp32), and the
    transformers model itself, already on ``device`` (the reference runs it as it is)."""
    import transformers

    from bench.gpu_check_cluster import TINY_LLAMA
    from pipeline.builtin_model import build_tokenizer

    tokenizer = build_tokenizer(300)
    shape = {k: v for k, v in TINY_LLAMA.items() if k not in ("tokenizer_vocab_size", "extra_vocab")} if dry_run \
        else TINYLLAMA
    config = transformers.LlamaConfig(**{**shape, "vocab_size": shape.get("vocab_size", len(tokenizer) + 7)},
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    model = model.to(torch.float32 if dry_run else torch.bfloat16).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model


def offline_stage(args) -> dict:
    """The 1.1B-shape offline comparison; its checkpoint (2.2 GB in bf16) is deleted after, pass or fail."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpu-check-1b-") as path:
        return _offline_stage(args, path)


def _offline_stage(args, path: str) -> dict:
    from pipeline import LLM, SamplingParams

    device, dry_run = args.device, args.dry_run
    num_prompts, max_tokens, lengths = (4, 8, (5, 40)) if dry_run else (64, 128, (64, 512))
    t0 = time.perf_counter()
    hf = build_model(path, device, dry_run)
    result = {"device": device, "dtype": "float32" if dry_run else "bfloat16",
              "model_build_s": round(time.perf_counter() - t0, 1),
              "num_prompts": num_prompts, "max_tokens": max_tokens, "prompt_lengths": list(lengths),
              "num_params": sum(p.numel() for p in hf.parameters())}
    rng = random.Random(0)
    vocab = hf.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(num_prompts)]
    out_tokens = num_prompts * max_tokens

    def hf_generate(batch: list[list[int]], new_tokens: int) -> float:
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                        pad_token_id=0)
        sync(device)
        return time.perf_counter() - start

    hf_generate(prompts[:2], 4)  # warm-up
    hf_s = hf_generate(prompts, max_tokens)
    result["transformers"] = {"seconds": round(hf_s, 2), "output_tok_per_s": round(out_tokens / hf_s, 1),
                              "attn_implementation": getattr(hf.config, "_attn_implementation", None)}
    print(result, flush=True)
    hf = None  # its weights leave the GPU before Tandem loads its own
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

    t0 = time.perf_counter()
    # no prefix caching: the timed run must prefill what the warm-up already did, as transformers does
    llm = LLM(model=path, model_config={"device": device, "dtype": result["dtype"]},
              kv_cache={"num_blocks": 4096 if not dry_run else 64, "enable_prefix_caching": False})
    result["tandem_load_s"] = round(time.perf_counter() - t0, 1)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    # the whole batch, a few tokens: triton compiles each kernel variant the timed run will launch
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    result["tandem_warmup_s"] = round(time.perf_counter() - t0, 1)
    sync(device)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    sync(device)
    tandem_s = time.perf_counter() - t0
    generated = sum(len(o.token_ids) for o in outputs)
    result["tandem"] = {"seconds": round(tandem_s, 2), "output_tok_per_s": round(generated / tandem_s, 1),
                        "total_tok_per_s": round((generated + sum(map(len, prompts))) / tandem_s, 1),
                        "kernels": llm.engine.kernels.name, "page_size": llm.config.kv_cache.page_size,
                        "max_batch_size": llm.config.max_batch_size,
                        "max_batch_input_tokens": llm.config.max_batch_input_tokens}
    result["tandem_over_transformers"] = round(result["tandem"]["output_tok_per_s"]
                                               / result["transformers"]["output_tok_per_s"], 2)
    result["ok"] = generated == out_tokens
    if not result["ok"]:
        result["error"] = f"Tandem generated {generated} tokens, expected {out_tokens}"
    print(result, flush=True)
    return result


STAGE_BODIES = {"kernels": kernels_stage, "kv-transfer": kv_transfer_stage, "offline": offline_stage}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "kv-receiver":
        return kv_receiver(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=sorted(STAGE_BODIES))
    parser.add_argument("--device", default="cuda")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return stage_main(lambda args: STAGE_BODIES[args.stage](args), parser, argv)


if __name__ == "__main__":
    sys.exit(main())
