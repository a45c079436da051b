"""gpu-check stage ``pd_cluster``: a real 1 prefill + 1 decode cluster on one device (both workers share the
GPU; ``model.device`` set for every process), every prompt prefilled remotely, its greedy completions
compared with the colocated engine's (the offline ``LLM``: prefill and decode in one engine, same device,
dtype and chunking), and every KV block back in both workers' pools afterwards.

fp32 on purpose: two correct bf16 runs with differently composed batches may part at near-ties, fp32 ones
do not. What transport moved the KV is read from the decode worker's log (its receiver logs each accepted
handshake): on a GPU it must be "cuda_ipc" (the prefill worker writes into the decode worker's cache, device to
device), on the CPU dry run "shm".
"""

from __future__ import annotations

import argparse
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.gpu_check import stage_main

# tests/conftest.py's tiny llama (GQA, padded vocabulary, llama3 RoPE scaling)
TINY_LLAMA = dict(tokenizer_vocab_size=300, extra_vocab=7, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, initializer_range=0.08,
                  rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64})
NUM_BLOCKS = 512  # explicit: two workers on one GPU must not each take 90% of its free memory
HEARTBEAT_S = 0.5  # the workers' default heartbeat period (worker.heartbeat_interval_s): the router's metrics lag it


def engine_config(device: str) -> dict:
    return {"kv_cache": {"page_size": 4, "num_blocks": NUM_BLOCKS}, "max_batch_input_tokens": 64,
            "model": {"device": device, "dtype": "float32"}}


def workload(num_prompts: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens): 1 to 150 tokens (longer than a 64-token chunk: chunked prefill), 1-24 new."""
    import random

    rng = random.Random(seed)
    return [([rng.randrange(3, 300) for _ in range(rng.choice([1, 5, 17, 40, 63, 64, 65, 150]))], rng.randint(1, 24))
            for _ in range(num_prompts)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def metric_samples(url: str) -> list[tuple[str, dict, float]]:
    samples = []
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        match = re.match(r'(tandem_[a-z_]+)\{(.*)\} ([0-9.e+-]+)$', line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            samples.append((match.group(1), labels, float(match.group(3))))
    return samples


def poll_metrics(url: str, read, is_done, timeout_s: float):
    """``read(samples)`` of the router's metrics every 0.25 s until ``is_done`` holds for it or the timeout:
    (whether it held, the last value read). The router shows what each worker's last heartbeat carried."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read(metric_samples(url))
        if is_done(value) or time.monotonic() >= deadline:
            return is_done(value), value
        time.sleep(0.25)


def handshake_transports(decode_log: Path) -> list[str]:
    """The transports the decode worker's KV receiver accepted, from its log lines."""
    text = decode_log.read_text(errors="replace") if decode_log.exists() else ""
    return sorted(set(re.findall(r"handshake accepted, transport (\w+)", text)))


def wait_for_blocks_back(url: str, workers: list[str], timeout_s: float = 15.0) -> dict:
    """{worker: (used, free)} once every worker reports 0 used and all blocks free (heartbeats lag ~0.5 s)."""
    def read(samples):
        gauges = {(name, labels.get("worker")): value for name, labels, value in samples}
        return {w: (gauges.get(("tandem_kv_blocks_used", w)), gauges.get(("tandem_kv_blocks_free", w)))
                for w in workers}

    def is_back(seen):
        return all(used == 0 and free == NUM_BLOCKS for used, free in seen.values())

    ok, seen = poll_metrics(url, read, is_back, timeout_s)
    return {"ok": ok, "blocks": seen}


def wait_for_transfers(url: str, worker: str, minimum: float, timeout_s: float = 10.0) -> dict:
    """The ``tandem_kv_transfer*`` counters ``worker`` reports, once its transfer count reaches ``minimum`` (or at
    the timeout): a short run can end before the heartbeat that counts its transfers, which then read as none."""
    def read(samples):
        return {metric: value for metric, labels, value in samples
                if metric.startswith("tandem_kv_transfer") and labels.get("worker") == worker}

    return poll_metrics(url, read, lambda counters: counters.get("tandem_kv_transfers_total", 0.0) >= minimum,
                        timeout_s)[1]


def gpu_processes() -> list[int]:
    """Pids that hold memory on the GPU (nvidia-smi), [] where it is missing."""
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=20)
    return [int(p) for p in out.stdout.split() if p.strip().isdigit()]


def run(args) -> dict:
    from deploy.local_launcher import LocalCluster
    from pipeline import LLM, SamplingParams
    from pipeline.builtin_model import build_checkpoint

    work = Path(tempfile.mkdtemp(prefix="gpu-check-cluster-"))
    model_path = str(build_checkpoint(work / "tiny-llama", "llama", **TINY_LLAMA))
    prompts = workload(8 if args.dry_run else 16)
    result: dict = {"device": args.device, "dtype": "float32", "num_requests": len(prompts)}

    t0 = time.monotonic()
    overrides = engine_config(args.device)
    llm = LLM(model=model_path, model_config=overrides.pop("model"), **overrides)
    outputs = llm.generate([p for p, _ in prompts],
                           [SamplingParams(max_tokens=n, temperature=0.0) for _, n in prompts])
    expected = [o.text for o in outputs]
    result["colocated_s"] = round(time.monotonic() - t0, 2)
    del llm, outputs

    config = {**engine_config(args.device), "router": {"max_local_prefill_length": 0}}
    cluster = LocalCluster(num_prefill=1, num_decode=1, model_path=model_path, port=free_port(), config=config,
                           log_dir=work / "logs")
    t0 = time.monotonic()
    try:
        cluster.start(timeout_s=120)
        result["cluster_start_s"] = round(time.monotonic() - t0, 2)
        pids = cluster.pids
        if args.device.startswith("cuda"):
            on_gpu = gpu_processes()  # empty where nvidia-smi cannot see processes (another pid namespace)
            result["workers_on_gpu"] = ({name: pids[name] in on_gpu for name in ("prefill-0", "decode-0")} if on_gpu
                                        else "unknown: nvidia-smi lists no compute process")
        url = cluster.url
        name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]

        def complete(item) -> str:
            prompt, max_tokens = item
            body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            response.raise_for_status()
            return response.json()["choices"][0]["text"]

        t0 = time.monotonic()
        sequential = [complete(item) for item in prompts]
        result["sequential_s"] = round(time.monotonic() - t0, 2)
        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            concurrent = list(pool.map(complete, prompts))
        result["concurrent_s"] = round(time.monotonic() - t0, 2)
        mismatches = [i for i, (a, b, c) in enumerate(zip(expected, sequential, concurrent)) if not a == b == c]
        result["exact_vs_colocated"] = not mismatches
        result["mismatches"] = [{"request": i, "colocated": expected[i], "sequential": sequential[i],
                                 "concurrent": concurrent[i]} for i in mismatches[:4]]
        # Not one per request: the second round's prompts may be cached on the decode worker already, and the
        # shortest prompts have no KV to send
        wait_for_transfers(url, "decode-0", minimum=len(prompts) // 2)
        time.sleep(2 * HEARTBEAT_S)  # every report read from here on was sent after the last request ended
        result["blocks_back"] = wait_for_blocks_back(url, ["prefill-0", "decode-0"])
        transfer = wait_for_transfers(url, "decode-0", minimum=0)  # the final counts
        result["transfer_counters_decode"] = transfer
        result["transports"] = handshake_transports(work / "logs" / "decode-0.log")
        seconds = transfer.get("tandem_kv_transfer_seconds_total", 0.0)
        moved = transfer.get("tandem_kv_transfer_bytes_total", 0.0)
        result["transfer_gbps_in_cluster"] = round(moved / seconds / 1e9, 3) if seconds else None
        num_transfers = transfer.get("tandem_kv_transfers_total", 0.0)
        result["remote_prefills"] = num_transfers
    finally:
        cluster.stop()
        for log in sorted((work / "logs").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-15:]
            print(f"--- {log.name} (last lines)\n" + "\n".join(tail))
        shutil.rmtree(work, ignore_errors=True)
    problems = []
    if not result["exact_vs_colocated"]:
        problems.append(f"{len(mismatches)} of {len(prompts)} completions differ from the colocated engine's")
    if not result["blocks_back"]["ok"]:
        problems.append(f"KV blocks not back: {result['blocks_back']['blocks']}")
    if num_transfers < len(prompts) // 2:
        problems.append(f"only {num_transfers:.0f} KV transfers for {len(prompts)} distinct prompts: the prefill "
                        "worker did not take them")
    wanted = "cuda_ipc" if args.device.startswith("cuda") else "shm"
    if result.get("transports") != [wanted]:
        problems.append(f"the KV went over {result.get('transports')}, not {wanted!r} alone")
    if isinstance(result.get("workers_on_gpu"), dict) and not all(result["workers_on_gpu"].values()):
        problems.append(f"not every worker holds GPU memory: {result.get('workers_on_gpu')}")
    result["ok"] = not problems
    if problems:
        result["error"] = "; ".join(problems)
    print({k: v for k, v in result.items() if k != "mismatches"})
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    return stage_main(run, parser, argv)


if __name__ == "__main__":
    sys.exit(main())
