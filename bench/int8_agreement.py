"""How closely W8A8 int8 follows bf16 on the same checkpoint: the peer benchmark's 1.1B shape and its
compressed-tensors W8A8 twin (``bench.peer_checkpoints``), both through Tandem on the CPU.

Two measures, as issue 34 asks:

- greedy agreement (``bench.bf16_agreement.agreement``): the int8 model's greedy continuations against the bf16
  model's, first token, whole continuation, and tokens before each request's first difference;
- teacher-forced: both models score the same sequences (each prompt followed by the bf16 model's greedy
  continuation; ``prompt_logprobs`` = 1), giving, over the continuations' positions, the largest and the median
  |logprob difference| of the token there and how often the int8 model's top token is the bf16 model's.

The same measures for the bf16 checkpoint run in fp32 against bf16 are the control: how far bf16's own rounding
moves this model. The model is random (near-flat next-token distributions: near-ties everywhere), so these rates
are pessimistic for trained checkpoints. Usage: ``python -m bench.int8_agreement --out bench/results/int8_agreement.json``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


def teacher_forced(bf16: list[list[dict]], int8: list[list[dict]], sequences: list[list[int]],
                   starts: list[int]) -> dict:
    """Over each sequence's positions from its ``starts`` entry on (its continuation): |logprob difference| of the
    token there, and top-1 agreement."""
    errors, same_top = [], []
    for ours, theirs, tokens, start in zip(int8, bf16, sequences, starts):
        for position in range(start, len(tokens)):
            token = tokens[position]
            errors.append(abs(ours[position][token] - theirs[position][token]))
            same_top.append(max(ours[position], key=ours[position].get) == max(theirs[position],
                                                                              key=theirs[position].get))
    return {"max_logprob_error": max(errors), "median_logprob_error": statistics.median(errors),
            "top1_agreement": sum(same_top) / len(same_top), "num_tokens": len(errors)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/int8_agreement.json"))
    parser.add_argument("--size", default="1.1b")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from bench.bf16_agreement import agreement, write_report
    from bench.peer_checkpoints import peer_checkpoint
    from bench.quantization_bench import cpu_description
    from pipeline import LLM, SamplingParams

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 30000) for _ in range(rng.randint(16, 128))] for _ in range(args.num_prompts)]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    results = {}
    for name, is_int8, dtype in (("bfloat16", False, "bfloat16"), ("int8", True, "bfloat16"),
                                 ("float32", False, "float32")):
        llm = LLM(model=str(peer_checkpoint(args.size, is_int8)), model_config={"dtype": dtype, "device": "cpu"})
        continuations = [o.token_ids for o in llm.generate(prompts, greedy)]
        if name == "bfloat16":
            sequences = [p + c for p, c in zip(prompts, continuations)]
        logprobs = [o.prompt_logprobs for o in llm.generate(sequences, scored)]
        results[name] = (continuations, logprobs, llm.engine.kernels.name)
        del llm
    bf16_tokens, bf16_logprobs, kernels = results["bfloat16"]
    scored_sequences, starts = [p + c for p, c in zip(prompts, bf16_tokens)], [len(p) for p in prompts]
    report = {
        "benchmark": "int8_agreement", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu_description(),
        "size": args.size, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "kernels": kernels,
        # int8 against bf16; and fp32 against bf16, the control: how far bf16's own rounding moves this model
        **{f"greedy_{name}_vs_bf16": agreement(results[name][0], bf16_tokens) for name in ("int8", "float32")},
        **{f"teacher_forced_{name}_vs_bf16": teacher_forced(bf16_logprobs, results[name][1], scored_sequences, starts)
           for name in ("int8", "float32")},
    }
    print(json.dumps({k: v for k, v in report.items() if k.startswith(("greedy", "teacher"))}, indent=1),
          file=sys.stderr)
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
