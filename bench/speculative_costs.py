"""The speculative benchmark's cost model: the target's forward timed alone with 1 and K + 1 tokens per
sequence, and the draft's 1-token forward, after a prefilled context (no sampling or host code); the
simple model's predicted speedup from those costs and the measured acceptance."""

from __future__ import annotations

import random
import statistics
import time

import torch


def ordinary_tokens(llm) -> list[int]:
    specials = set(llm.tokenizer.all_special_ids)
    return [t for t in range(llm.engine.vocab_size) if t not in specials]


def _forward(model, kv_cache, kernels, batch) -> torch.Tensor:
    hidden = model(batch, kv_cache, kernels)  # [num_tokens, hidden]
    return model.compute_logits(batch.sampled_rows(hidden)).float()  # [rows, vocab]


@torch.inference_mode()
def measure_costs(llm, batch_size: int, args) -> dict:
    """Median ms of one target forward with 1 and K + 1 tokens per sequence, and of one 1-token draft forward,
    for ``batch_size`` sequences after a prefilled ``--cost-context-len``-token context (``llm`` speculates)."""
    from pipeline.speculative.flat_batch import TokenRun, build_forward_batch

    engine = llm.engine
    runner, proposer = engine.runner, engine.speculator.proposer
    models = {"target": (runner.model, runner.kv_cache), "draft": (proposer.draft.model, proposer.kv_cache)}
    rng = random.Random(args.seed + 1000 + batch_size)
    ordinary = ordinary_tokens(llm)
    context = args.cost_context_len
    ids = [f"spec-bench-cost-{i}" for i in range(batch_size)]
    engine.kv_manager.reset_prefix_cache()
    try:
        tables = []
        for seq_id in ids:
            if engine.kv_manager.allocate(seq_id, [], context + max(args.ks) + 1) is None:
                raise RuntimeError("the KV pool cannot hold the cost measurement's sequences")
            tables.append(engine.kv_manager.block_table(seq_id))
        contexts = [[rng.choice(ordinary) for _ in range(context)] for _ in ids]
        for model, kv_cache in models.values():  # both models' KV of the context, as after a prefill
            runs = [TokenRun(c, 0, table) for c, table in zip(contexts, tables)]
            _forward(model, kv_cache, runner.kernels,
                     build_forward_batch(runs, [context * (i + 1) - 1 for i in range(len(runs))], runner.page_size,
                                         runner.device))

        def batch_of(num_tokens: int):
            runs = [TokenRun([rng.choice(ordinary) for _ in range(num_tokens)], context, table) for table in tables]
            return build_forward_batch(runs, list(range(batch_size * num_tokens)), runner.page_size, runner.device)

        calls = {"target_1": ("target", batch_of(1)), "draft_1": ("draft", batch_of(1))}
        for k in args.ks:
            calls[f"target_{k + 1}"] = ("target", batch_of(k + 1))
        samples = {name: [] for name in calls}
        names = list(calls)
        for rep in range(2 + args.cost_reps):  # two untimed rounds first
            for name in (names if rep % 2 == 0 else list(reversed(names))):
                model, kv_cache = models[calls[name][0]]
                start = time.perf_counter()
                _forward(model, kv_cache, runner.kernels, calls[name][1])
                if rep >= 2:
                    samples[name].append(1e3 * (time.perf_counter() - start))
    finally:
        for seq_id in ids:
            engine.kv_manager.free(seq_id)
    ms = {name: statistics.median(values) for name, values in samples.items()}
    return dict(
        context_len=context, reps=args.cost_reps, median_ms=ms,
        p90_ms={name: _p90(values) for name, values in samples.items()},
        draft_step_ratio=ms["draft_1"] / ms["target_1"],
        verify_cost_ratio={str(k): ms[f"target_{k + 1}"] / ms["target_1"] for k in args.ks},
    )


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]


def add_predictions(result: dict) -> None:
    """The simple model's speedup beside the measured one, for each K of ``result``."""
    costs = result["costs"]
    for spec in result["speculative"]:
        k = spec["num_speculative_tokens"]
        step_cost = k * costs["draft_step_ratio"] + costs["verify_cost_ratio"][str(k)]  # in target decode steps
        spec.update(verify_cost_ratio=costs["verify_cost_ratio"][str(k)], predicted_step_cost=step_cost,
                    predicted_speedup=spec["acceptance"]["mean_acceptance_length"] / step_cost,
                    measured_speedup=spec["ratio_on_off"])
