"""How closely Tandem's bf16 greedy decoding follows transformers' bf16 greedy decoding, as rates.

Both run the same checkpoint cast to bf16 on the CPU; bf16 sums in a different order round
differently, so two correct bf16 engines part ways at near-ties, and once a token differs the rest of
that sequence does too. The report gives, per dtype:

- ``first_token_agreement``: requests whose first generated token is the same;
- ``request_exact_match``: requests whose whole continuation is the same;
- ``prefix_agreement``: generated tokens before each request's first difference, over all tokens;

with fp32 as the control (Tandem is token-exact with transformers there: every rate 1.0). Usage::

    python -m bench.bf16_agreement --out bench/results/bf16_agreement.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    def common_prefix(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    total = sum(len(t) for t in theirs)
    return {
        "first_token_agreement": sum(a[:1] == b[:1] for a, b in zip(ours, theirs)) / len(theirs),
        "request_exact_match": sum(a == b for a, b in zip(ours, theirs)) / len(theirs),
        "prefix_agreement": sum(common_prefix(a, b) for a, b in zip(ours, theirs)) / total,
        "num_requests": len(theirs), "num_tokens": total,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/bf16_agreement.json"))
    parser.add_argument("--model", default=None, help="HF checkpoint (default: the medium random benchmark model)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from bench.serve_compare import benchmark_checkpoint
    from pipeline import LLM, SamplingParams

    model_path = args.model or str(benchmark_checkpoint("medium"))
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(16, 256))] for _ in range(args.num_prompts)]
    report: dict = {"benchmark": "bf16_agreement", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": model_path,
                    "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "dtypes": {}}
    for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        llm = LLM(model=model_path, model_config={"dtype": dtype_name, "device": "cpu"})
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        ours = [o.token_ids for o in llm.generate(prompts, params)]
        kernels = llm.engine.kernels.name
        del llm
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
        with torch.no_grad():
            theirs = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False,
                                  pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        report["dtypes"][dtype_name] = {**agreement(ours, theirs), "tandem_kernels": kernels}
        print(dtype_name, json.dumps(report["dtypes"][dtype_name]), file=sys.stderr)
    write_report(args.out, report)
    return 0


def write_report(path: Path, report: dict) -> None:
    """``report`` as indented JSON at ``path`` (its folder made), said on stderr."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
