"""``tandem generate``: offline generation from command-line prompts or a JSONL file, to JSONL."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from deploy.config_flags import add_config_flags, config_overrides

_SAMPLING_FLAGS = {
    "max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float, "seed": int,
    "logprobs": int, "frequency_penalty": float, "presence_penalty": float, "repetition_penalty": float,
    "min_tokens": int,
}


def register(sub) -> None:
    parser = sub.add_parser("generate", help="generate offline; prompts from arguments or --input JSONL")
    parser.add_argument("prompts", nargs="*", help="prompt texts")
    parser.add_argument("--input", type=Path, help='JSONL: {"prompt": str} or {"prompt_token_ids": [int]} '
                        "per line, optionally with sampling fields overriding the flags")
    parser.add_argument("--output", type=Path, help="JSONL output file (default: stdout)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    for name, kind in _SAMPLING_FLAGS.items():  # unset: the config's sampling section, then the checkpoint's
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                            help=f"this run's {name} (default: sampling.{name} of the config, then "
                                 "generation_config.json)" if name in ("max_tokens", "temperature", "top_p", "top_k")
                            else None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", default=None)
    add_config_flags(parser)
    parser.set_defaults(handler=run)


def read_requests(args: argparse.Namespace) -> list[dict[str, Any]]:
    requests: list[dict[str, Any]] = [{"prompt": p} for p in args.prompts]
    if args.input is not None:
        if not args.input.is_file():
            raise FileNotFoundError(f"--input: no such file: {args.input}")
        for line_no, line in enumerate(args.input.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--input line {line_no}: not valid JSON ({exc.msg})") from None
            if not isinstance(item, dict) or not ({"prompt", "prompt_token_ids"} & item.keys()):
                raise ValueError(f'--input line {line_no}: expected an object with "prompt" or "prompt_token_ids"')
            requests.append(item)
    if not requests:
        raise ValueError("no prompts: pass prompt texts as arguments or --input FILE.jsonl")
    return requests


def run(args: argparse.Namespace) -> int:
    # Everything a user can get wrong (prompts, sampling fields, the config, the checkpoint) is checked
    # before torch is imported, so bad input is one line in a fraction of a second, not after the imports.
    from pipeline.config import PipelineConfig
    from pipeline.generation_config import read_generation_config, resolved_defaults
    from pipeline.protocol import SamplingParams

    from deploy.checkpoint_check import check_checkpoints

    requests = read_requests(args)
    overrides = config_overrides(args)
    model_section = overrides.pop("model", {})
    model_path = model_section.pop("model_path", None)
    llm_args = dict(model=model_path, model_config=model_section, config_file=args.config_file,
                    section_name=args.section_name, **overrides)
    config = PipelineConfig.load(args.config_file, args.section_name,
                                 overrides={**overrides, "model": {**model_section, **(
                                     {"model_path": model_path} if model_path is not None else {})}})
    check_checkpoints(config)
    # what a flag or a request leaves unset: the config's sampling section, else the checkpoint's generation_config
    defaults = resolved_defaults(config.sampling, read_generation_config(config.model.model_path))
    base = {k: getattr(args, k) for k in (*_SAMPLING_FLAGS, "stop", "ignore_eos") if getattr(args, k) is not None}
    params_list = []
    for i, item in enumerate(requests):
        fields = {**defaults, **base, **{k: v for k, v in item.items() if k not in ("prompt", "prompt_token_ids")}}
        try:
            params_list.append(SamplingParams(**fields))
        except TypeError as exc:
            raise ValueError(f"request {i}: unknown sampling field ({exc})") from None
    prompts = [item.get("prompt_token_ids") or item["prompt"] for item in requests]
    if config.tensor_parallel_size > 1:  # torch not run yet here: ranks 1..N-1 fork now, warm (rank_start.py)
        from pipeline.parallel.rank_start import prefork_warm_ranks

        prefork_warm_ranks(config.tensor_parallel_size - 1)

    from tqdm import tqdm

    from pipeline import LLM

    llm = LLM(**llm_args)
    out = open(args.output, "w") if args.output else sys.stdout
    try:
        with tqdm(total=len(prompts), desc="generate", unit="req", disable=args.no_progress, file=sys.stderr) as bar:
            results = llm.generate(prompts, params_list, on_finished=lambda _: bar.update(1))
        if llm.engine.speculator is not None:
            stats = llm.engine.speculator.stats
            print(f"speculative decoding: {stats.num_accepted_tokens} of {stats.num_draft_tokens} draft tokens "
                  f"accepted ({stats.acceptance_rate:.0%}), {stats.mean_acceptance_length:.2f} tokens per verify",
                  file=sys.stderr)
        for item, result in zip(requests, results):
            record = {"prompt": item.get("prompt"), "text": result.text, "token_ids": result.token_ids,
                      "finish_reason": result.finish_reason}
            if result.logprobs is not None:
                record["logprobs"] = [{str(k): v for k, v in step.items()} for step in result.logprobs]
            out.write(json.dumps(record) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    return 0
