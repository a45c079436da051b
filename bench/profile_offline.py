"""Where Tandem's offline time goes: ``torch.profiler`` over one ``LLM.generate`` of the peer benchmark's workload::

    taskset -c 0 python -m bench.profile_offline --model-size 1.1b --dtype bfloat16 --threads 1

The engine is loaded and warmed up on the first 4 prompts (as ``bench/offline_runner.py`` does), then one run of
the whole workload is profiled; the table (self CPU time per op, top ``--rows``) is printed and written to
``--out`` as JSON with the wall time and tok/s of the profiled run and of one unprofiled run before it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-size", default="1.1b")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16, float32 or int8 (the W8A8 checkpoint)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoTokenizer

    from bench.peer_checkpoints import peer_checkpoint
    from bench.peer_offline import LARGE_WORKLOADS, offline_workload
    from pipeline import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    checkpoint = peer_checkpoint(args.model_size, args.dtype == "int8")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    shape = LARGE_WORKLOADS.get(args.model_size, dict(num_prompts=48, min_prompt_len=16, max_prompt_len=512,
                                                       output_len=96))
    workload = offline_workload(argparse.Namespace(seed=args.seed, **shape), len(tokenizer),
                                set(tokenizer.all_special_ids))
    dtype = "bfloat16" if args.dtype == "int8" else args.dtype
    llm = LLM(model=str(checkpoint), model_config={"dtype": dtype, "device": "cpu"}, max_batch_size=64,
              max_batch_input_tokens=2048, max_length=2048, kv_cache={"cpu_kv_cache_gib": 2})
    prompts, max_tokens = workload["prompt_token_ids"], workload["max_tokens"]

    def run(num: int | None = None) -> float:
        llm.engine.kv_manager.reset_prefix_cache()
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens[:num]]
        started = time.perf_counter()
        llm.generate(prompts[:num], params)
        return time.perf_counter() - started

    run(4)
    plain_s = run()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled_s = run()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
    print(table)
    tokens = sum(max_tokens)
    rows = [{"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3, "count": e.count}
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:args.rows]]
    report = {"model_size": args.model_size, "dtype": args.dtype, "threads": args.threads, "workload": shape,
              "plain_wall_s": plain_s, "plain_tok_s": tokens / plain_s, "profiled_wall_s": profiled_s,
              "top_self_cpu": rows}
    print(json.dumps({k: v for k, v in report.items() if k != "top_self_cpu"}))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
