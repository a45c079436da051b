"""Plots of ``bench/peer_compare.py``'s report: ``NAME_offline.png`` (tokens/s per engine, dtype and thread
count, every repeat shown) and ``NAME_online.png`` (output throughput and p50/p99 TPOT per system and rate)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"tandem": "tab:blue", "vllm": "tab:orange", "tandem-colocated": "tab:blue", "tandem-1p1d": "tab:green"}


def plot_offline(report: dict, out: Path) -> Path:
    configs = report["offline"]["configs"]
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.9 * len(configs)))
    labels, y = [], 0
    for config in configs:
        for offset, engine in ((0.2, "tandem"), (-0.2, "vllm")):
            runs = [r["output_tokens_per_s"] for r in config["runs"][engine]]
            median = config["median_output_tokens_per_s"][engine]
            ax.barh(y + offset, median, height=0.38, color=COLORS[engine], label=engine if y == 0 else None)
            ax.scatter(runs, [y + offset] * len(runs), s=10, color="black", alpha=0.5, zorder=3)
            ax.text(max([median, *runs]), y + offset, f"  {median:.0f}", va="center", fontsize=8)
        size = f"{config['model_size']} " if "model_size" in config else ""
        labels.append(f"{size}{config['dtype']}, {config['threads']} thread(s)\n"
                      f"Tandem/vLLM {config['ratio_tandem_over_vllm']:.2f}x")
        y += 1
    ax.set_yticks(range(len(configs)), labels)
    ax.set_xlabel("output tokens/s (median bar, repeats as dots)")
    if len({c.get("model_size") for c in configs}) > 1:
        ax.set_xscale("log")  # shapes 100x apart in speed share the axis
    ax.set_title(f"Offline LLM.generate, {report['machine']['cpu']}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = out.with_name(out.stem + "_offline.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_online(report: dict, out: Path) -> Path:
    systems = report["online"]["systems"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    names = list(systems)
    rates = sorted({r["request_rate"] for rep in systems.values() for r in rep["runs"]})
    width = 0.8 / max(len(names), 1)
    for metric, ax, title in (("output_throughput", axes[0], "output tokens/s"),
                              ("median_tpot_ms", axes[1], "p50 TPOT (ms)"), ("p99_tpot_ms", axes[2], "p99 TPOT (ms)")):
        for i, name in enumerate(names):
            values = [next((r[metric] for r in systems[name]["runs"] if r["request_rate"] == rate), math.nan)
                      for rate in rates]
            xs = [k + (i - (len(names) - 1) / 2) * width for k in range(len(rates))]
            ax.bar(xs, values, width=width, color=COLORS.get(name, "tab:gray"), label=name)
        ax.set_xticks(range(len(rates)), [f"{r:g} req/s" if math.isfinite(r) else "all at once" for r in rates])
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle("Online: mixed workload (30 % 1500->8, 70 % 32->96), same cores")
    fig.tight_layout()
    path = out.with_name(out.stem + "_online.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_peer(report: dict, json_path: Path) -> list[Path]:
    json_path = Path(json_path)
    paths = []
    if report.get("offline", {}).get("configs"):
        paths.append(plot_offline(report, json_path))
    if report.get("online", {}).get("systems"):
        paths.append(plot_online(report, json_path))
    return paths
