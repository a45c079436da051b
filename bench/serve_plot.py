"""Plots of serving-benchmark reports: latency percentiles vs request rate, and DistServe-style SLO
attainment vs rate with the attainment target drawn. One line per system: a ``serve`` report is one
system, a ``serve_compare`` report (``bench/serve_compare.py``) holds several. For the mixed workload
the TPOT panel shows the short requests (the decodes a long prefill can stall)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

PANELS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "end-to-end latency"))


def systems_of(report: dict) -> dict[str, dict]:
    if report.get("benchmark") == "serve_compare":
        return report["systems"]
    return {report.get("label") or report["base_url"]: report}


def _finite_runs(report: dict) -> list[dict]:
    return [r for r in report["runs"] if not math.isinf(r["request_rate"])]


def _metrics_of(run: dict, name: str) -> dict:
    """The short requests' metrics for TPOT/ITL on a mixed workload, everyone's otherwise."""
    if name in ("tpot", "itl") and "short" in run.get("groups", {}):
        return run["groups"]["short"]
    return run


def plot_latencies(systems: dict[str, dict], out: Path) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for (name, title), ax in zip(PANELS, axes.flat):
        for color, (label, report) in zip(plt.cm.tab10.colors, systems.items()):
            runs = _finite_runs(report)
            rates = [r["request_rate"] for r in runs]
            ax.plot(rates, [_metrics_of(r, name)[f"median_{name}_ms"] for r in runs], "o-", color=color,
                    label=f"{label} p50")
            ax.plot(rates, [_metrics_of(r, name)[f"p99_{name}_ms"] for r in runs], "s--", color=color,
                    label=f"{label} p99")
        slo = next(iter(systems.values()))["goodput_slos"].get(f"{name}_ms")
        if slo:
            ax.axhline(slo, color="tab:red", linewidth=0.8, label=f"SLO {slo:g} ms")
        is_short = name in ("tpot", "itl") and any("short" in r.get("groups", {})
                                                   for rep in systems.values() for r in rep["runs"])
        ax.set_title(f"{title}{' (short requests)' if is_short else ''}", fontsize="medium")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize="x-small")
    fig.suptitle(_title(systems), fontsize="medium")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_attainment(systems: dict[str, dict], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5))
    first = next(iter(systems.values()))
    for color, (label, report) in zip(plt.cm.tab10.colors, systems.items()):
        runs = _finite_runs(report)
        ax.plot([r["request_rate"] for r in runs], [100 * r["slo_attainment"] for r in runs], "o-", color=color,
                label=f"{label} (goodput rate {report.get('goodput_rate')})")
    target = 100 * first["attainment_target"]
    ax.axhline(target, color="tab:red", linestyle="--", label=f"{target:.0f} % target")
    ax.set_ylim(0, 105)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("requests within every SLO (%)")
    slos = ", ".join(f"{k.removesuffix('_ms').upper()} <= {v:g} ms" for k, v in first["goodput_slos"].items())
    ax.set_title(f"SLO attainment ({slos})", fontsize="medium")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _title(systems: dict[str, dict]) -> str:
    workload = next(iter(systems.values()))["workload"]
    if workload["dataset"] == "mixed":
        shape = (f"mixed: {workload['long_fraction']:.0%} long {workload['long_input_len']}->"
                 f"{workload['long_output_len']}, short {workload['short_input_len']}->{workload['short_output_len']}")
    else:
        shape = f"random {workload['input_len']}->{workload['output_len']}"
    return f"Serving latency vs request rate ({workload['num_prompts']} requests, {shape})"


def render_serve(report: dict, json_path: Path) -> list[Path]:
    """Write the plots of ``report`` beside ``json_path``; returns their paths (none for a run with
    no finite rate to draw a curve over)."""
    systems = systems_of(report)
    if not any(_finite_runs(r) for r in systems.values()):
        return []
    paths = [plot_latencies(systems, json_path.with_name(json_path.stem + "_latency.png"))]
    if next(iter(systems.values()))["goodput_slos"]:
        paths.append(plot_attainment(systems, json_path.with_name(json_path.stem + "_slo.png")))
    return paths
