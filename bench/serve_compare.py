"""Does disaggregation pay? Tandem 1P1D vs Tandem colocated vs ``transformers serve
--continuous-batching``, one after another on the same checkpoint, the same cores and the same
arrivals (``make bench-serve``)::

    python -m bench.serve_compare --out bench/results/serve_compare.json

Each system gets the same cores (``--cores``, default all of this process's): the colocated worker
all of them, 1P1D one share each (``deploy.cpu_plan``), transformers' server all of them. The
router, and the benchmark client, run beside them unpinned (the same for every system). The
checkpoint is a random-weight Llama (``--model-size``, default "medium": hidden 512, 8 layers) whose
end-of-sequence row of the output layer is zero, so greedy decoding never stops early and every
request produces exactly its ``max_tokens`` on every system (transformers' server has no ``ignore_eos``).

The report holds every system's sweep (``bench/serve.py``'s report), the exact commands, and the
comparisons the targets are stated in (``comparisons``); plots are written beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path

from bench.peer_transformers import TransformersServe, free_port, make_eos_unreachable
from bench.serve import benchmark
from bench.serve_cli import add_mixed_arguments, parse_rates
from bench.serve_client import ClientSettings
from bench.serve_metrics import parse_goodput
from bench.serve_workload import CHAT_ENDPOINT, WorkloadSpec

SYSTEMS = ("tandem-1p1d", "tandem-colocated", "transformers-serve", "tandem-1p1d-spill")
PEER_ARGS = ("--cb-num-blocks", "256", "--cb-max-batch-tokens", "512")  # 256-token blocks: 1 GiB of KV here
# (prefill, decode, colocated)
TANDEM_SHAPES = {"tandem-1p1d": (1, 1, 0), "tandem-colocated": (0, 0, 1), "tandem-1p1d-spill": (1, 1, 0)}
# 1P1D whose decode worker also prefills prompts behind a long prefill queue, in chunks of at most 48 tokens beside
# its decodes (docs/load.md, "Conditional disaggregation": 48 kept 64's throughput with a lower p99 TPOT)
TANDEM_CONFIGS = {"tandem-1p1d-spill": {"router": {"prefill_spill_tokens": 2048},
                                        "max_prefill_tokens_beside_decodes": 48}}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the machine type where that cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def benchmark_checkpoint(size: str) -> Path:
    """The benchmark's checkpoint (built once, cached under ``$TANDEM_HOME``): EOS is unreachable."""
    from bench.offline_throughput import MODEL_SIZES
    from pipeline.builtin_model import build_checkpoint

    home = Path(os.environ.get("TANDEM_HOME", Path.home() / ".cache" / "tandem"))
    path = home / f"bench-{size}-no-eos"
    if not (path / "config.json").is_file():
        staging = path.with_name(path.name + ".partial")
        build_checkpoint(staging, "llama", **MODEL_SIZES[size])
        make_eos_unreachable(staging)
        staging.rename(path)
    return path


def run_tandem(name: str, checkpoint: Path, cores: list[int], run, dtype: str | None = None) -> tuple[dict, str]:
    """Serve ``checkpoint`` as ``name`` (TANDEM_SHAPES) on ``cores`` with ``tandem up``'s placement (in ``dtype``
    where given) and run the client ``run`` against it: (its report, the equivalent command)."""
    from deploy.config_flags import override_flags
    from deploy.cpu_plan import describe_plan, plan_cores, router_cores
    from deploy.local_launcher import LocalCluster
    from pipeline.core_list import format_core_list

    num_prefill, num_decode, num_colocated = TANDEM_SHAPES[name]
    plan = plan_cores(cores, num_prefill, num_decode, num_colocated)
    beside_router = router_cores(plan)
    config = {**TANDEM_CONFIGS.get(name, {}), **({"model": {"dtype": dtype}} if dtype else {})}
    cluster = LocalCluster(num_prefill=num_prefill, num_decode=num_decode, num_colocated=num_colocated,
                           model_path=str(checkpoint), port=free_port(), cpu_plan=plan, router_cores=beside_router,
                           config=config)
    flags = " ".join(f"--{flag} {n}" for flag, n in zip(("prefill", "decode", "colocated"), TANDEM_SHAPES[name]))
    settings = "".join(f" {flag}" for flag in override_flags(config))
    command = (f"tandem up --model {checkpoint} {flags} --cpu-cores {format_core_list(cores)}{settings}  "
               f"# {describe_plan(plan)} | router (and this client): cores {format_core_list(beside_router)}")
    with cluster, client_on(beside_router):  # the client runs where tandem up puts the router
        report = run(cluster.url, checkpoint.name)
    return report, command


@contextlib.contextmanager
def client_on(cores: list[int]):
    """Run the benchmark client (this process's main thread) on ``cores`` for the block."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def run_transformers(checkpoint: Path, cores: list[int], run) -> tuple[dict, str]:
    # its KV pool and per-step token budget sized like Tandem's defaults (1 GiB of KV; 512 tokens a step)
    server = TransformersServe(checkpoint, cores=cores, num_threads=len(cores), extra_args=PEER_ARGS)
    with server, client_on(cores):
        report = run(server.url, server.model_name)
    return report, " ".join(server.command)


def compare(systems: dict[str, dict]) -> dict:
    """The numbers the targets are stated in (see docs/benchmarks.md)."""
    out: dict = {}
    pd, colo, peer = (systems.get(k) for k in ("tandem-1p1d", "tandem-colocated", "transformers-serve"))
    if pd and colo:
        ref_rate = colo.get("goodput_rate") or min(r["request_rate"] for r in colo["runs"])
        at = {k: next(r for r in rep["runs"] if r["request_rate"] == ref_rate) for k, rep in (("pd", pd), ("colo", colo))}
        short = {k: run.get("groups", {}).get("short", run) for k, run in at.items()}
        out["pd_vs_colocated"] = {
            "reference_rate": ref_rate,
            "reference_rate_is_colocated_goodput_rate": colo.get("goodput_rate") is not None,
            "short_p99_tpot_ms": {"tandem-1p1d": short["pd"]["p99_tpot_ms"], "tandem-colocated": short["colo"]["p99_tpot_ms"]},
            "short_p99_tpot_ratio": short["colo"]["p99_tpot_ms"] / short["pd"]["p99_tpot_ms"],
            "short_p99_tpot_ratio_by_rate": {
                str(run["request_rate"]): run.get("groups", {}).get("short", run)["p99_tpot_ms"]
                / other.get("groups", {}).get("short", other)["p99_tpot_ms"]
                for run, other in zip(colo["runs"], pd["runs"]) if run["request_rate"] == other["request_rate"]},
            "goodput_rate": {"tandem-1p1d": pd.get("goodput_rate"), "tandem-colocated": colo.get("goodput_rate")},
            "goodput_rate_ratio": ((pd.get("goodput_rate") or 0.0) / colo["goodput_rate"]) if colo.get("goodput_rate") else None,
            "failed": {"tandem-1p1d": sum(r["failed"] for r in pd["runs"]),
                       "tandem-colocated": sum(r["failed"] for r in colo["runs"])},
            "targets": {"short_p99_tpot_ratio": 2.0, "goodput_rate_ratio": 1.5, "failed": 0},
        }
    if colo and peer:  # at the sweep's top rate: "inf" (everything at once) measures capacity
        top = max(r["request_rate"] for r in colo["runs"])
        at = {k: next(r for r in rep["runs"] if r["request_rate"] == top) for k, rep in (("colo", colo), ("peer", peer))}
        out["colocated_vs_transformers"] = {
            "rate": top,
            "output_throughput": {"tandem-colocated": at["colo"]["output_throughput"],
                                  "transformers-serve": at["peer"]["output_throughput"]},
            "output_throughput_ratio": at["colo"]["output_throughput"] / max(at["peer"]["output_throughput"], 1e-9),
            "p99_ttft_ms": {"tandem-colocated": at["colo"]["p99_ttft_ms"], "transformers-serve": at["peer"]["p99_ttft_ms"]},
            "failed": {"tandem-colocated": sum(r["failed"] for r in colo["runs"]),
                       "transformers-serve": sum(r["failed"] for r in peer["runs"])},
            "targets": {"output_throughput_ratio": 3.0, "p99_ttft": "lower", "failed": 0},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/serve_compare.json"))
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    parser.add_argument("--model-size", default="medium", choices=["small", "medium"])
    parser.add_argument("--cores", default=None, help="cores every system gets, e.g. 0-1 (default: all of ours)")
    parser.add_argument("--request-rate", "--rate", default="0.5,1,1.5,2,2.5,3,inf")
    parser.add_argument("--num-prompts", type=int, default=60)
    add_mixed_arguments(parser)
    parser.add_argument("--goodput", nargs="+", default=["ttft:3000", "tpot:30"], metavar="NAME:MS")
    parser.add_argument("--attainment-target", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from pipeline.core_list import parse_core_list

    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"--systems: unknown {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    cores = parse_core_list(args.cores) if args.cores else sorted(os.sched_getaffinity(0))
    checkpoint = benchmark_checkpoint(args.model_size)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    spec = WorkloadSpec(dataset="mixed", num_prompts=args.num_prompts, long_fraction=args.mixed_long_fraction,
                        long_input_len=args.mixed_long_input_len, long_output_len=args.mixed_long_output_len,
                        short_input_len=args.mixed_short_input_len, short_output_len=args.mixed_short_output_len,
                        seed=args.seed)
    rates, slos = parse_rates(args.request_rate), parse_goodput(args.goodput)

    def runner(label: str):
        def run(url: str, model: str) -> dict:
            # the chat endpoint: the one every system serves
            client = ClientSettings(base_url=url, endpoint=CHAT_ENDPOINT, model=model)
            return benchmark(client, spec, rates, tokenizer=tokenizer, slos=slos,
                             attainment_target=args.attainment_target, progress=not args.no_progress, label=label)
        return run

    reports, commands = {}, {}
    for name in systems:
        started = time.monotonic()
        if name == "transformers-serve":
            reports[name], commands[name] = run_transformers(checkpoint, cores, runner(name))
        else:
            reports[name], commands[name] = run_tandem(name, checkpoint, cores, runner(name))
        print(f"{name}: done in {time.monotonic() - started:.0f} s", flush=True)
    result = {
        "benchmark": "serve_compare", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cores": cores,
        "checkpoint": {"size": args.model_size, "path": str(checkpoint)}, "commands": commands,
        "bench_command": " ".join(["python -m bench.serve_compare", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"cpu": cpu_model(), "cores_online": os.cpu_count(),
                    "python": platform.python_version()},
        "loadavg_1min_after": os.getloadavg()[0],
        "systems": reports, "comparisons": compare(reports),
    }
    from bench.serve_plot import render_serve

    write_comparison(result, args.out, render_serve)
    return 0


def write_comparison(result: dict, out: Path, render) -> None:
    """Write a comparison report's JSON and its plots (``render(result, out)`` -> paths); print where."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["comparisons"], indent=2))
    for path in [out, *render(result, out)]:
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
