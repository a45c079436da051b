"""Offline throughput with tensor parallelism on this machine: TP 2 against TP 1, same checkpoint, same settings.

The ~150M random llama of ``bench.offline_throughput`` ("large": 16 heads, 4 KV heads, fp32) through
``LLM.generate``: prefill (8 prompts of 128 tokens, one output token each) and decode (8 prompts of 16
tokens, 32 greedy tokens each). Both engines are loaded at once and take turns (the fastest of
``--repeats`` rounds). Each engine gets the machine's cores: TP 1 one process with all of them as torch
threads, TP 2 two rank processes with half each (rank 0 is this process: its thread count is set before
each of its calls). The CPU model and the load average are recorded with the numbers; nothing asserts
a timing. Usage: ``python -m bench.tensor_parallel_bench --out bench/results/tensor_parallel.json``
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from bench.quantization_bench import cpu_description, interleaved_seconds

NUM_PROMPTS, PREFILL_LEN, DECODE_PROMPT_LEN, DECODE_TOKENS = 8, 128, 16, 32


def main() -> None:
    from bench.offline_throughput import MODEL_SIZES
    from pipeline import LLM, SamplingParams
    from pipeline.builtin_model import build_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/tensor_parallel.json")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    cpu = cpu_description()  # before the runs change this process's thread count
    generator = torch.Generator().manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory() as directory:
        path = str(build_checkpoint(Path(directory) / "large", "llama", **MODEL_SIZES["large"]))
        vocab_size = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
        long_prompts = [torch.randint(3, vocab_size, (PREFILL_LEN,), generator=generator).tolist()
                        for _ in range(NUM_PROMPTS)]
        short_prompts = [torch.randint(3, vocab_size, (DECODE_PROMPT_LEN,), generator=generator).tolist()
                         for _ in range(NUM_PROMPTS)]
        engines = {size: LLM(path, tensor_parallel_size=size, model_config={"dtype": "float32"},
                             kv_cache={"num_blocks": 512, "page_size": 16, "enable_prefix_caching": False})
                   for size in (1, 2)}
        prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        decode = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)

        def call(size, prompts, params):
            def run():
                torch.set_num_threads(max(1, cores // size))  # rank 0's share; the other ranks set theirs at start
                return engines[size].generate(prompts, params)
            return run

        same_tokens = ([o.token_ids for o in call(1, short_prompts, decode)()]
                       == [o.token_ids for o in call(2, short_prompts, decode)()])
        calls = {(size, phase): call(size, prompts, params) for size in engines
                 for phase, prompts, params in (("prefill", long_prompts, prefill), ("decode", short_prompts, decode))}
        timings = interleaved_seconds(calls, args.repeats)
        for size in engines:
            entry = {"tensor_parallel_size": size, "threads_per_rank": max(1, cores // size),
                     "prefill_tokens_per_s": round(NUM_PROMPTS * PREFILL_LEN / timings[size, "prefill"], 1),
                     "decode_output_tokens_per_s": round(NUM_PROMPTS * DECODE_TOKENS / timings[size, "decode"], 1)}
            results.append(entry)
            print(json.dumps(entry), flush=True)
        for llm in engines.values():
            llm.close()
    report = {"cpu": cpu, "load_average_1m_after": os.getloadavg()[0], "cores": cores,
              "model": "bench.offline_throughput 'large' (~150M, fp32)",
              "num_prompts": NUM_PROMPTS, "prefill_prompt_len": PREFILL_LEN, "decode_prompt_len": DECODE_PROMPT_LEN,
              "decode_tokens": DECODE_TOKENS, "greedy_tokens_equal": same_tokens, "repeats": args.repeats,
              "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
