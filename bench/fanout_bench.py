"""n choices from one request against the same choices as n separate requests, offline, on the medium
benchmark model: wall time and peak KV blocks, with the tokens checked identical (choice j of the n
request draws with ``choice_seed(seed, j)``, so request j seeded that way must give the same tokens).
The separate requests run with the prefix cache emptied first; admitted together, they each compute
the prompt. Usage::

    python -m bench.fanout_bench --out bench/results/fanout.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/fanout.json"))
    parser.add_argument("--model", default=None, help="HF checkpoint (default: the medium random benchmark model)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from bench.serve_compare import benchmark_checkpoint
    from pipeline import LLM, SamplingParams
    from pipeline.protocol.requests import choice_seed

    model_path = args.model or str(benchmark_checkpoint("medium"))
    llm = LLM(model=model_path, kv_cache={"page_size": 16, "num_blocks": 4096}, max_batch_input_tokens=2048)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]

    def params(seed: int, n: int = 1) -> SamplingParams:
        return SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=seed, n=n, ignore_eos=True)

    def one_request_each() -> list[list[list[int]]]:
        outputs = llm.generate(prompts, params(1, args.n))
        return [[c.token_ids for c in out.choices] for out in outputs]

    def separate_requests() -> list[list[list[int]]]:
        outputs = llm.generate([p for p in prompts for _ in range(args.n)],
                               [params(choice_seed(1, j)) for _ in prompts for j in range(args.n)])
        return [[outputs[i * args.n + j].token_ids for j in range(args.n)] for i in range(len(prompts))]

    def measure(run) -> tuple[float, int, list]:
        kv = llm.engine.kv_manager
        kv.reset_prefix_cache()
        free, peak = kv.num_free_blocks, 0
        step = llm.engine.step

        def counting_step():
            nonlocal peak
            out = step()
            peak = max(peak, free - kv.num_free_blocks)
            return out

        llm.engine.step = counting_step
        try:
            start = time.perf_counter()
            tokens = run()
            return time.perf_counter() - start, peak, tokens
        finally:
            llm.engine.step = step

    measure(one_request_each), measure(separate_requests)  # warm-up
    runs = []
    for _ in range(args.repeats):
        fan_s, fan_peak, fan_tokens = measure(one_request_each)
        sep_s, sep_peak, sep_tokens = measure(separate_requests)
        assert fan_tokens == sep_tokens, "choice j must equal a request seeded with choice_seed(seed, j)"
        runs.append({"n_request_s": fan_s, "separate_s": sep_s, "n_request_peak_blocks": fan_peak,
                     "separate_peak_blocks": sep_peak})
        print(f"n={args.n} in one request: {fan_s:.2f} s, peak {fan_peak} blocks | {args.n} requests: "
              f"{sep_s:.2f} s, peak {sep_peak} blocks", file=sys.stderr)
    report = {
        "benchmark": "fanout",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": model_path,
        "workload": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                     "n": args.n, "threads": args.threads, "page_size": 16},
        "runs": runs,
        "median_time_ratio_separate_over_n": statistics.median(r["separate_s"] / r["n_request_s"] for r in runs),
        "median_peak_blocks": {"n_request": statistics.median(r["n_request_peak_blocks"] for r in runs),
                               "separate": statistics.median(r["separate_peak_blocks"] for r in runs)},
        "tokens_identical": True,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")
    return 0


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    n = report["workload"]["n"]
    labels = [f"one request per prompt, n={n}", f"{n} requests per prompt"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
    left.bar(labels, [statistics.median(r["n_request_s"] for r in runs), statistics.median(r["separate_s"] for r in runs)])
    left.set_ylabel("wall time, s (median)")
    right.bar(labels, [report["median_peak_blocks"]["n_request"], report["median_peak_blocks"]["separate"]])
    right.set_ylabel("peak KV blocks")
    fig.suptitle(f"{report['workload']['num_prompts']} prompts x {report['workload']['prompt_len']} tokens, "
                 f"{report['workload']['max_tokens']} out per choice")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
