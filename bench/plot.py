"""Render a benchmark's JSON report as a PNG next to it (or at ``--out``).

    python -m bench.plot bench/results/transfer_bench.json     # -> bench/results/transfer_bench.png

Knows the reports of ``bench/``: ``offline_throughput`` (tok/s per system, every repeat shown),
``transfer`` (GB/s per transport and baseline, every repeat shown, targets drawn), ``kernels``
(achieved bandwidth against the peak), ``overlap`` (tok/s with the overlap scheduler off and on per
batch size, every repeat shown, beside each batch size's step split into host and compute),
``structured_output`` (µs per decode step of mask fill, accept and apply per grammar backend and batch
size, p90 whiskers), ``speculative`` (tok/s with speculation off and per K for each batch size,
acceptance per draft position, measured speedup beside the cost model's), ``prompt_attention`` (ns per
query-key pair of the native kernel and torch's flash attention per chunk size), and the serving reports
``serve`` / ``serve_compare`` (``bench/serve_plot.py``: ``NAME_latency.png`` and ``NAME_slo.png``).
Needs matplotlib (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def kind_of(report: dict) -> str:
    if report.get("benchmark") in ("offline_throughput", "transfer", "overlap", "structured_output", "speculative",
                                   "startup", "prompt_attention"):
        return report["benchmark"]
    if "results" in report and "peak_gbps" in report:
        return "kernels"
    raise ValueError("not a bench/ report: expected offline_throughput, transfer, overlap, structured_output, "
                     "speculative or kernel_bench JSON")


def _bar(ax, y: int, median: float, repeats: list[float]) -> None:
    """The median's value, printed past the bar and every repeat (drawn as dots on the bar)."""
    ax.scatter(repeats, [y] * len(repeats), s=10, color="black", alpha=0.5, zorder=3)
    ax.text(max([median, *repeats]), y, f"  {median:.3g}", va="center")


def plot_offline(report: dict, ax) -> str:
    systems = ["tandem", "transformers"]
    medians = [report[s]["median_output_tokens_per_s"] for s in systems]
    ax.barh(systems, medians, color=["tab:blue", "tab:gray"])
    for i, system in enumerate(systems):
        _bar(ax, i, medians[i], [r["output_tokens_per_s"] for r in report[system]["runs"]])
    ax.invert_yaxis()
    ax.set_xlabel("output tokens / s (median; dots: each repeat)")
    settings = report["settings"]
    return (f"Offline throughput, {report['workload']['num_prompts']} requests, {settings['threads']} thread(s): "
            f"Tandem / transformers = {report['ratio_output_tokens_per_s']:.2f}x")


def plot_transfer(report: dict, ax) -> str:
    total_gb = report["config"]["total_mib"] * 2**20 / 1e9
    names = [n for n in report if isinstance(report[n], dict) and "gb_per_s" in report[n]]
    colors = ["tab:blue" if n in ("zmq", "shm") else "tab:gray" for n in names]
    ax.barh(names, [report[n]["gb_per_s"] for n in names], color=colors)
    for i, name in enumerate(names):
        _bar(ax, i, report[name]["gb_per_s"], [total_gb / s for s in report[name]["runs_s"]])
    targets = report.get("targets", {"zmq": 0.7, "shm": 0.5})
    for name, reference, color in (("zmq", report["raw_zmq_gb_per_s"], "tab:red"),
                                   ("shm", report["memcpy_gb_per_s"], "tab:green")):
        ax.axvline(targets[name] * reference, color=color, linestyle="--",
                   label=f"{name} target: {targets[name]} x {reference:.2f} GB/s")
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize="small")
    ax.set_xlabel("GB/s (median; dots: each repeat)")
    ratios = report["ratios"]
    return (f"KV transfer, {report['config']['total_mib']:.0f} MiB: zmq / raw = {ratios['zmq_vs_raw_zmq']:.2f}, "
            f"shm / memcpy = {ratios['shm_vs_memcpy']:.2f}")


def plot_kernels(report: dict, ax) -> str:
    results = report["results"]
    labels = [f"{r['kernel']} {r['case']}" for r in results]
    ax.barh(labels, [r["triton_pct_peak"] for r in results], color="tab:blue")
    ax.invert_yaxis()
    ax.set_xlabel(f"% of peak bandwidth ({report['peak_gbps']} GB/s)")
    median = statistics.median(r["triton_pct_peak"] for r in results) if results else 0.0
    return f"Triton kernels on {report['device']} ({report['dtype']}): median {median:.0f}% of peak"


OVERLAP_MODES = {"off": "tab:gray", "on": "tab:blue"}
STEP_PARTS = {"host": "tab:orange", "compute": "tab:blue"}


def plot_overlap(report: dict, axes) -> str:
    """Left: tok/s per batch size, overlap off and on (dots: each repeat). Right: an overlap-off step's
    time split into host and compute, the most overlap could hide."""
    throughput, split = axes
    results = report["results"]
    labels = [f"batch {r['batch_size']}" for r in results]
    width = 0.38
    for offset, (mode, color) in zip((-width / 2, width / 2), OVERLAP_MODES.items()):
        xs = [i + offset for i in range(len(results))]
        medians = [r[mode]["median_output_tokens_per_s"] for r in results]
        throughput.bar(xs, medians, width, color=color, label=f"overlap {mode}")
        for x, r, median in zip(xs, results, medians):
            repeats = [run["output_tokens_per_s"] for run in r[mode]["runs"]]
            throughput.scatter([x] * len(repeats), repeats, s=10, color="black", alpha=0.5, zorder=3)
            top = max([median, *repeats])
            throughput.text(x, top, f"{median:,.0f}", ha="center", va="bottom", fontsize="small")
    throughput.set_xticks(range(len(results)), labels)
    rates = [r[m]["median_output_tokens_per_s"] for r in results for m in OVERLAP_MODES]
    if max(rates) > 5 * min(rates):  # batch 1 would be a sliver beside batch 64
        throughput.set_yscale("log")
        throughput.set_ylim(bottom=min(rates) / 4)
    throughput.set_ylabel("output tokens / s (median; dots: each repeat)")
    throughput.legend(loc="upper left", fontsize="small")
    profiles = [r["profile_overlap_off"] for r in results]
    bottom = [0.0] * len(results)
    for part, color in STEP_PARTS.items():
        values = [p.get(f"{part}_us_per_step", 0.0) / 1e3 for p in profiles]
        split.bar(labels, values, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, p in enumerate(profiles):
        if "host_share" in p:
            split.text(i, bottom[i], f"host {p['host_share']:.0%}", ha="center", va="bottom", fontsize="small")
    split.set_ylabel("ms per step, overlap off")
    split.legend(loc="upper left", fontsize="small")
    ratios = ", ".join(f"batch {r['batch_size']} {r['ratio_on_off']:.2f}x" for r in results)
    identical = "identical" if report["outputs_identical"] else "DIFFERENT"
    return (f"Overlap scheduler, {report['settings']['threads']} thread(s): on / off = {ratios}; "
            f"tokens {identical}")


STRUCTURED_PARTS = {"fill": "tab:orange", "accept": "tab:green", "apply": "tab:blue",
                    "apply_llguidance": "tab:gray"}
STRUCTURED_LABELS = {"apply": "apply (pipeline.sampler)", "apply_llguidance": "apply (llguidance, compiled)"}


def plot_structured_output(report: dict, ax) -> str:
    """Grouped bars, one group per backend and batch size: median µs per step of each part (whisker: p90)."""
    results = report["results"]
    parts = [p for p in STRUCTURED_PARTS if any(p in r for r in results)]
    width = 0.8 / max(len(parts), 1)
    for k, part in enumerate(parts):
        xs = [i + (k - (len(parts) - 1) / 2) * width for i in range(len(results))]
        stats = [r.get(part, {"median_us": 0.0, "p90_us": 0.0}) for r in results]
        medians = [s["median_us"] for s in stats]
        ax.bar(xs, medians, width, color=STRUCTURED_PARTS[part], label=STRUCTURED_LABELS.get(part, part))
        p90s = [s["p90_us"] for s in stats]
        ax.vlines(xs, medians, p90s, color="black", linewidth=1)
        for x, median, p90 in zip(xs, medians, p90s):
            if median > 0:
                ax.text(x, max(median, p90), f"{median:,.0f}", ha="center", va="bottom", fontsize="x-small")
    ax.set_xticks(range(len(results)), [f"{r['backend']}\nbatch {r['batch_size']}" for r in results])
    values = [r[p]["median_us"] for r in results for p in parts if p in r and r[p]["median_us"] > 0]
    if values and max(values) > 20 * min(values):  # batch 1's accept would vanish beside batch 64's fill
        ax.set_yscale("log")
    ax.set_ylabel("µs per step, whole batch (median; whisker: p90)")
    ax.legend(loc="upper left", fontsize="small")
    settings = report["settings"]
    title = f"Structured output per decode step, vocab {settings['vocab_size']:,}, {settings['threads']} thread(s)"
    missing = [name for name, b in report.get("backends", {}).items() if not b.get("available", True)]
    if missing:
        title += f" ({', '.join(missing)} unavailable, not measured)"
    shares = [f"{r['backend']} {r['fill_share_of_reference_step']:.0%}" for r in results
              if "fill_share_of_reference_step" in r]
    if shares:
        reference = report["reference"]
        title += (f"\nmask fill at batch {reference['batch_size']} / the overlap bench's overlap-off step "
                  f"({reference['step_us'] / 1e3:.1f} ms): " + ", ".join(shares))
    checked = "all masks allow the document" if report["masks_allow_document"] else "A MASK REJECTED THE DOCUMENT"
    return f"{title}; {checked}"


SPEC_COLORS = ["tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:red"]


def plot_speculative(report: dict, axes) -> str:
    """Left: tok/s per batch size, speculation off and per K (dots: each repeat). Middle: the share of
    verifies that accepted each draft position. Right: measured speedup on / off beside the cost model's."""
    throughput, accepted, speedup = axes
    results = report["results"]
    modes = ["off", *(f"k{k}" for k in report["settings"]["num_speculative_tokens"])]
    width = 0.8 / len(modes)
    for m, (mode, color) in enumerate(zip(modes, SPEC_COLORS)):
        xs = [i + (m - (len(modes) - 1) / 2) * width for i in range(len(results))]
        medians = [r[mode]["median_output_tokens_per_s"] for r in results]
        throughput.bar(xs, medians, width, color=color, label="speculation off" if mode == "off" else f"K = {mode[1:]}")
        for x, r, median in zip(xs, results, medians):
            repeats = [run["output_tokens_per_s"] for run in r[mode]["runs"]]
            throughput.scatter([x] * len(repeats), repeats, s=10, color="black", alpha=0.5, zorder=3)
            throughput.text(x, max([median, *repeats]), f"{median:,.0f}", ha="center", va="bottom", fontsize="small")
    throughput.set_xticks(range(len(results)), [f"batch {r['batch_size']}" for r in results])
    throughput.set_ylabel("output tokens / s (median; dots: each repeat)")
    throughput.legend(loc="upper left", fontsize="small")
    labels, measured, predicted = [], [], []
    for r in results:
        for s, color in zip(r["speculative"], SPEC_COLORS[1:]):
            k, rates = s["num_speculative_tokens"], s["acceptance"]["acceptance_per_position"]
            style = "-" if r is results[0] else "--"
            length = s["acceptance"]["mean_acceptance_length"]
            accepted.plot(range(1, len(rates) + 1), rates, style, marker="o", color=color,
                          label=f"K={k} batch {r['batch_size']} ({length:.2f} tokens / verify)")
            labels.append(f"b{r['batch_size']} K={k}\nverify {s['verify_cost_ratio']:.2f}")
            measured.append(s["measured_speedup"])
            predicted.append(s["predicted_speedup"])
    accepted.set_ylim(0, 1.05)
    accepted.set_xticks(range(1, max(report["settings"]["num_speculative_tokens"]) + 1))
    accepted.set_xlabel("draft position")
    accepted.set_ylabel("share of verifies accepting it")
    accepted.legend(loc="lower left", fontsize="x-small")
    xs = range(len(labels))
    speedup.bar([x - 0.2 for x in xs], measured, 0.4, color="tab:blue", label="measured (tok/s on / off)")
    speedup.bar([x + 0.2 for x in xs], predicted, 0.4, color="tab:gray",
                label="model: tokens per verify / (K x draft + verify)")
    for x, value in zip(xs, measured):
        speedup.text(x - 0.2, value, f"{value:.2f}", ha="center", va="bottom", fontsize="x-small")
    speedup.axhline(1.0, color="black", linewidth=0.8)
    speedup.set_ylim(0, 1.35 * max([1.0, *measured, *predicted]))  # room for the legend above the bars
    speedup.set_xticks(list(xs), labels, fontsize="small")
    speedup.set_ylabel("speedup over speculation off (verify: its cost in decode steps)")
    speedup.legend(loc="upper left", fontsize="x-small")
    settings = report["settings"]
    ratios = ", ".join(f"batch {r['batch_size']} K={s['num_speculative_tokens']} {s['ratio_on_off']:.2f}x"
                       for r in results for s in r["speculative"])
    identical = "identical" if report["outputs_identical"] else "DIFFERENT"
    return (f"Speculative decoding, {report['model']['draft']['num_hidden_layers']}-layer draft, "
            f"{settings['threads']} thread(s): on / off = {ratios}; tokens {identical}")


def plot_startup(report: dict, axes) -> str:
    """Seconds to a served request (cluster start) and back to serving after a SIGKILL, per way of starting."""
    labels = list(report["runs"])
    for ax, (key, what) in zip(axes, (("ready_s", "tandem up to first answer (s)"),
                                      ("killed_worker_serving_again_s", "SIGKILL to serving again (s)"))):
        medians = [statistics.median(run[key] for run in report["runs"][label]["runs"]) for label in labels]
        ax.barh(labels, medians, color=["tab:blue", "tab:gray"][:len(labels)])
        for y, label in enumerate(labels):
            _bar(ax, y, medians[y], [run[key] for run in report["runs"][label]["runs"]])
        ax.invert_yaxis()
        ax.set_xlabel(what + " (median; dots: each run)")
    return f"Start-up, 1P1D, built-in model, {report['cpu'].get('model', '?')} ({report['cpu'].get('cores')} cores)"


def plot_prompt_attention(report: dict, ax) -> str:
    """ns per query-key pair against the chunk's query rows, native and torch's path, per cached prefix."""
    for prefix in sorted({case["prefix"] for case in report["cases"]}):
        cases = [case for case in report["cases"] if case["prefix"] == prefix]
        rows = [case["rows"] for case in cases]
        for path, style in (("native", "-"), ("torch", "--")):
            ax.plot(rows, [case[f"{path}_ns_per_pair"] for case in cases], style, marker="o",
                    label=f"{path}, {prefix} cached keys")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("query rows in the chunk")
    ax.set_ylabel("ns per query-key pair (median)")
    ax.legend(fontsize="small")
    best = report["torch_faster_from_rows"]
    return (f"bf16 prompt attention, {report['cpu']['model']}, {report['threads']} thread(s): torch's path faster "
            f"from {best if best is not None else 'no'} rows")


PLOTTERS = {"startup": plot_startup, "offline_throughput": plot_offline, "transfer": plot_transfer, "kernels": plot_kernels,
            "overlap": plot_overlap, "structured_output": plot_structured_output, "speculative": plot_speculative,
            "prompt_attention": plot_prompt_attention}
PANELS = {"overlap": 2, "speculative": 3, "startup": 2}  # kinds drawn on more than one axis (their plotter takes them all)
FIGSIZES = {"startup": (12, 3), "structured_output": (10, 5),  # one-axis kinds drawn as vertical bars, not one bar per row
            "speculative": (17, 5), "prompt_attention": (9, 5)}


def render(report: dict, out: Path) -> Path:
    """Write the plot of ``report`` to ``out`` (PNG) and return it."""
    kind = kind_of(report)
    num_panels = PANELS.get(kind, 1)
    if num_panels > 1:
        fig, axes = plt.subplots(1, num_panels, figsize=FIGSIZES.get(kind, (12, 4.5)))
    elif kind in FIGSIZES:
        fig, axes = plt.subplots(figsize=FIGSIZES[kind])
    else:  # one horizontal bar per row
        rows = (len(report.get("results", []))
                or sum(isinstance(v, dict) and "gb_per_s" in v for v in report.values()) or 2)
        fig, axes = plt.subplots(figsize=(10, 1.6 + 0.35 * rows))
    try:
        title = PLOTTERS[kind](report, axes)
        (fig.suptitle if num_panels > 1 else axes.set_title)(title, fontsize="medium")
        fig.tight_layout()
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", type=Path, help="a JSON report written by a bench/ script")
    parser.add_argument("--out", type=Path, help="PNG path (default: the report's path with .png)")
    args = parser.parse_args(argv)
    try:
        report = json.loads(args.report.read_text())
        if report.get("benchmark") in ("serve", "serve_compare"):  # several PNGs, named after the report
            from bench.serve_plot import render_serve

            outs = render_serve(report, args.out or args.report)
        else:
            outs = [render(report, args.out or args.report.with_suffix(".png"))]
    except (OSError, ValueError, KeyError) as exc:
        print(f"bench.plot: {args.report}: {exc!r}", file=sys.stderr)
        return 2
    for out in outs:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
