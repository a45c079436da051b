"""Offline throughput: Tandem's ``LLM.generate`` against transformers' batched ``generate()``.

Both engines run the same checkpoint, in fp32, on the same CPU threads, over the same seeded
mixed-length workload (greedy, EOS ignored, a different ``max_tokens`` per request):

- Tandem gets every request at once and schedules them itself (continuous batching, chunked prefill,
  paged KV cache).
- transformers gets the requests in fixed batches of ``--hf-batch-size`` in workload order, left-padded
  with an attention mask; each batch runs ``max_new_tokens`` = the largest request of that batch.

Throughput counts *useful* output tokens only: each request's own ``max_tokens``. The tokens that
transformers generates past a request's ``max_tokens`` (because a longer request shares its batch) are
waste; they are reported separately (``generated_tokens``) but never counted as throughput.

Each repeat runs the engines back to back (order alternating); the JSON has every repeat and the
medians. Usage::

    python -m bench.offline_throughput --out bench/results/offline_throughput.json
    python -m bench.offline_throughput --size medium --num-prompts 32 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

# Random-weight llama checkpoints the benchmark builds when --model is not given. "small" is the
# built-in model's shape; "medium" has 8x its weights (and per-token compute) and 4x its KV bytes per token.
MODEL_SIZES: dict[str, dict] = {
    "small": dict(
        tokenizer_vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048, initializer_range=0.05,
    ),
    "medium": dict(
        tokenizer_vocab_size=2048, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048, initializer_range=0.05,
    ),
    # ~150M parameters: a step costs what a small real checkpoint's does here, so prefill dominates TTFT
    "large": dict(
        tokenizer_vocab_size=2048, hidden_size=1024, intermediate_size=2752, num_hidden_layers=12,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048, initializer_range=0.03,
    ),
}

COUNTING_NOTE = (
    "output_tokens counts useful tokens only: the sum of each request's own max_tokens (EOS ignored, so "
    "every request produces exactly that many). transformers runs each padded batch to the largest "
    "max_tokens in it; generated_tokens counts those extra tokens too, but throughput never does."
)


@dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class RunResult:
    wall_s: float
    output_tokens: int  # useful tokens (sum of max_tokens)
    generated_tokens: int  # tokens the engine computed, padding waste included
    num_requests: int
    loadavg_1min: float = -1.0  # machine load when the run ended: other tenants show up here

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.wall_s


def make_workload(args, vocab_size: int, special_ids: list[int]) -> list[Request]:
    """Seeded prompts of uniform random length and content (no shared prefixes), uniform output lengths.

    Prompt tokens are drawn from the ordinary (non-special) ids of the model's vocabulary.
    """
    rng = random.Random(args.seed)
    specials = set(special_ids)
    ordinary = [t for t in range(vocab_size) if t not in specials]
    requests = []
    for _ in range(args.num_prompts):
        prompt_len = rng.randint(args.min_prompt_len, args.max_prompt_len)
        prompt = [rng.choice(ordinary) for _ in range(prompt_len)]
        requests.append(Request(prompt, rng.randint(args.min_output_len, args.max_output_len)))
    return requests


def ensure_model(args) -> str:
    """``--model`` as given, else a random-weight checkpoint of ``--size``, built once under the cache dir."""
    if args.model:
        return args.model
    from pipeline.builtin_model import build_checkpoint

    home = Path(os.environ.get("TANDEM_HOME", Path.home() / ".cache" / "tandem"))
    path = home / f"bench-llama-{args.size}-v1"
    if not (path / "model.safetensors").is_file():
        print(f"building the {args.size} benchmark checkpoint at {path}", file=sys.stderr)
        build_checkpoint(path, "llama", seed=0, **MODEL_SIZES[args.size])
    return str(path)


# ------------------------------------------------------------------------------------------ Tandem
def make_tandem(model_path: str, args):
    from pipeline import LLM

    return LLM(
        model=model_path,
        model_config={"dtype": "float32", "device": "cpu"},
        kernel_backend="torch",
        max_batch_size=args.max_batch_size,
        max_batch_input_tokens=args.max_batch_input_tokens,
    )


def run_tandem(llm, requests: list[Request]) -> tuple[RunResult, list[list[int]]]:
    from pipeline import SamplingParams

    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests]
    prompts = [r.prompt_token_ids for r in requests]
    llm.engine.kv_manager.reset_prefix_cache()  # a repeat must not reuse the previous repeat's prompts
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    num_tokens = sum(len(o.token_ids) for o in outputs)
    expected = sum(r.max_tokens for r in requests)
    if num_tokens != expected:
        raise RuntimeError(f"Tandem produced {num_tokens} tokens, the workload asks for {expected}")
    return RunResult(wall, num_tokens, num_tokens, len(requests), _loadavg()), [o.token_ids for o in outputs]


# ------------------------------------------------------------------------------------ transformers
def make_hf(model_path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@torch.inference_mode()
def run_hf(model, requests: list[Request], batch_size: int, pad_token_id: int) -> tuple[RunResult, list[list[int]]]:
    useful = generated = 0
    token_ids: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        max_new = max(r.max_tokens for r in batch)
        input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)  # [batch, width], left-padded
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            input_ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            attention_mask[row, width - len(r.prompt_token_ids) :] = 1
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,  # EOS ignored, as Tandem's ignore_eos
            do_sample=False,
            pad_token_id=pad_token_id,
        )  # [batch, width + max_new]
        for row, r in enumerate(batch):
            token_ids.append(out[row, width : width + r.max_tokens].tolist())
        useful += sum(r.max_tokens for r in batch)
        generated += len(batch) * max_new
    wall = time.perf_counter() - start
    return RunResult(wall, useful, generated, len(requests), _loadavg()), token_ids


# ------------------------------------------------------------------------------------------ report
def _loadavg() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else -1.0


def summarize(runs: list[RunResult]) -> dict:
    return dict(
        median_wall_s=statistics.median(r.wall_s for r in runs),
        median_output_tokens_per_s=statistics.median(r.output_tokens_per_s for r in runs),
        median_requests_per_s=statistics.median(r.requests_per_s for r in runs),
        output_tokens=runs[0].output_tokens,
        generated_tokens=runs[0].generated_tokens,
        runs=[dict(asdict(r), output_tokens_per_s=r.output_tokens_per_s, requests_per_s=r.requests_per_s) for r in runs],
    )


def machine_info(num_threads: int) -> dict:
    import transformers

    cpu_model = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return dict(
        cpu_count=os.cpu_count(),
        cpu_model=cpu_model or platform.processor(),
        torch_num_threads=num_threads,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        python_version=platform.python_version(),
        platform=platform.platform(),
    )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results/offline_throughput.json", help="JSON result path")
    parser.add_argument("--model", default=None, help="HF checkpoint directory (default: build a random llama)")
    parser.add_argument("--size", choices=sorted(MODEL_SIZES), default="small", help="random model shape without --model")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-prompt-len", type=int, default=16)
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--min-output-len", type=int, default=16)
    parser.add_argument("--max-output-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine; medians are reported")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch threads for both engines (default 1: on a shared machine, OpenMP threads that wait at "
        "barriers for a core another process holds measure the neighbours, not the engines)",
    )
    parser.add_argument("--hf-batch-size", type=int, default=16, help="transformers generate() batch size")
    parser.add_argument("--max-batch-size", type=int, default=64, help="Tandem max_batch_size")
    parser.add_argument("--max-batch-input-tokens", type=int, default=2048, help="Tandem max_batch_input_tokens")
    parser.add_argument("--skip-hf", action="store_true", help="time Tandem only (profiling)")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    num_threads = args.threads
    torch.set_num_threads(num_threads)
    model_path = ensure_model(args)

    llm = make_tandem(model_path, args)
    tokenizer = llm.tokenizer
    vocab_size = llm.engine.vocab_size
    requests = make_workload(args, vocab_size, tokenizer.all_special_ids)
    warmup = requests[:4]
    hf_model = None if args.skip_hf else make_hf(model_path)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    print(f"model {model_path}; {len(requests)} requests, {sum(r.max_tokens for r in requests)} output tokens, "
          f"{sum(len(r.prompt_token_ids) for r in requests)} prompt tokens; {num_threads} threads", file=sys.stderr)
    run_tandem(llm, warmup)
    if hf_model is not None:
        run_hf(hf_model, warmup, args.hf_batch_size, pad_token_id)

    tandem_runs: list[RunResult] = []
    hf_runs: list[RunResult] = []
    tandem_tokens = hf_tokens = None
    for repeat in range(args.repeats):
        order = ["tandem", "hf"] if repeat % 2 == 0 else ["hf", "tandem"]
        for engine in order:
            if engine == "tandem":
                result, tandem_tokens = run_tandem(llm, requests)
                tandem_runs.append(result)
            elif hf_model is not None:
                result, hf_tokens = run_hf(hf_model, requests, args.hf_batch_size, pad_token_id)
                hf_runs.append(result)
            else:
                continue
            print(f"repeat {repeat}: {engine:>6} {result.wall_s:7.2f} s  {result.output_tokens_per_s:8.1f} tok/s",
                  file=sys.stderr)

    report = dict(
        benchmark="offline_throughput",
        counting=COUNTING_NOTE,
        model=dict(path=model_path, size=None if args.model else args.size,
                   config=None if args.model else MODEL_SIZES[args.size], dtype="float32", device="cpu",
                   vocab_size=vocab_size),
        workload=dict(
            num_prompts=args.num_prompts, seed=args.seed,
            prompt_len=[args.min_prompt_len, args.max_prompt_len], output_len=[args.min_output_len, args.max_output_len],
            total_prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
            total_output_tokens=sum(r.max_tokens for r in requests),
            sampling="greedy (temperature 0), ignore_eos, per-request max_tokens",
        ),
        settings=dict(
            repeats=args.repeats, threads=num_threads, hf_batch_size=args.hf_batch_size,
            hf_padding="left, attention_mask, max_new_tokens = max of the batch",
            tandem=dict(max_batch_size=args.max_batch_size, max_batch_input_tokens=args.max_batch_input_tokens,
                        kernel_backend="torch", page_size=llm.config.kv_cache.page_size),
        ),
        machine=machine_info(num_threads),
        tandem=summarize(tandem_runs),
    )
    if hf_runs:
        report["transformers"] = summarize(hf_runs)
        report["ratio_output_tokens_per_s"] = (
            report["tandem"]["median_output_tokens_per_s"] / report["transformers"]["median_output_tokens_per_s"]
        )
        # Each repeat runs both engines back to back, so its own ratio sees the same neighbours.
        report["ratio_per_repeat"] = [t.output_tokens_per_s / h.output_tokens_per_s for t, h in zip(tandem_runs, hf_runs)]
        # Padded fp32 batches reorder reductions, so a few near-tie argmaxes may flip; informational only.
        report["requests_token_identical"] = sum(a == b for a, b in zip(tandem_tokens, hf_tokens))
        print(f"Tandem / transformers output tokens/s: {report['ratio_output_tokens_per_s']:.2f}x", file=sys.stderr)

    write_report(report, args.out)
    return report


def write_report(report: dict, path: str | Path) -> None:
    """A benchmark's JSON report, indented, at ``path`` (its folder made if missing)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
