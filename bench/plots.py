"""PNG plots of a report: throughput against latency, latency CDFs, occupancy and queue depth over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen before pyplot loads)

from bench.records import RunResult, summarize  # noqa: E402
from bench.records import BenchReport  # noqa: E402

MODE_COLORS = {"static": "tab:red", "dynamic": "tab:orange", "continuous": "tab:blue",
               "hf-generate": "tab:gray", "hf-generate-batch": "tab:green"}


def _color(system: str) -> str:
    return MODE_COLORS.get(system, "tab:purple")


def plot_throughput_latency(report: BenchReport, path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    online = [r for r in report.runs if r.mode == "online"]
    for system in dict.fromkeys(r.system for r in online):
        # In order of offered load, saturation last.
        points = sorted((summarize(r) for r in online if r.system == system),
                        key=lambda s: (s.get("rate_per_s") is None, s.get("rate_per_s") or 0.0))
        xs = [s["output_tokens_per_s"] for s in points]
        for ax, metric in zip(axes, ("ttft_ms", "e2e_ms")):
            ax.plot(xs, [s[metric]["p95"] / 1000.0 for s in points], marker="o", color=_color(system), label=system)
            for x, s in zip(xs, points):
                ax.annotate(s.get("rate", ""), (x, s[metric]["p95"] / 1000.0), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
    axes[0].set_ylabel("TTFT p95 (s)")
    axes[1].set_ylabel("end-to-end latency p95 (s)")
    for ax in axes:
        ax.set_xlabel("throughput (output tokens/s)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    _one_legend(fig, axes[0], "batching mode (point labels: Poisson arrival rate as a share of continuous's rate at saturation)")
    fig.suptitle("Online, through gateway + Redis: throughput against latency across the rate sweep")
    return _save(fig, path)


def _cdf(ax: plt.Axes, values: list[float], color: str, label: str) -> None:
    ordered = sorted(values)
    if ordered:
        ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", color=color, label=label)


def plot_latency_cdfs(report: BenchReport, path: Path, workload: str = "skewed") -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in (r for r in report.runs if r.workload == workload and r.mode in ("offline", "peer")):
        done = [(t.arrival_s, t.first_token_s, t.finished_s) for t in run.requests
                if t.finished_s is not None and t.first_token_s is not None]
        color, label = _color(run.system), f"{run.system} ({run.mode})"
        _cdf(axes[0], [first - arrival for arrival, first, _ in done], color, label)
        _cdf(axes[1], [finished - arrival for arrival, _, finished in done], color, label)
    axes[0].set_xlabel("time to first token (s)")
    axes[1].set_xlabel("end-to-end latency (s)")
    for ax in axes:
        ax.set_ylabel("share of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
    _one_legend(fig, axes[0], "system")
    fig.suptitle(f"Latency CDFs, {workload} workload, all requests at once")
    return _save(fig, path)


def plot_timeline(report: BenchReport, path: Path, workload: str = "skewed") -> Path:
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    runs: list[RunResult] = [r for r in report.runs if r.workload == workload and r.mode == "offline"]
    for run in runs:
        ts = [s.t_s for s in run.timeline]
        axes[0].plot(ts, [100.0 * s.num_running / run.max_num_seqs for s in run.timeline],
                     color=_color(run.system), label=run.system, linewidth=1, drawstyle="steps-post")
        axes[1].plot(ts, [s.num_waiting for s in run.timeline], color=_color(run.system), linewidth=1,
                     drawstyle="steps-post")
    axes[0].set_ylabel("batch occupancy (% of slots\nholding a live request)")
    axes[1].set_ylabel("queue depth (requests waiting)")
    axes[1].set_xlabel("time since start of run (s)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    _one_legend(fig, axes[0], "batching mode")
    fig.suptitle(f"Batch occupancy and queue depth over time, {workload} workload, engine direct")
    return _save(fig, path)


def _one_legend(fig: plt.Figure, ax: plt.Axes, title: str) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, title=title, loc="lower center", ncol=min(5, len(handles)), fontsize=8,
                   bbox_to_anchor=(0.5, 0.0))


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout(rect=(0, 0.12, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(report: BenchReport, output_dir: Path) -> list[Path]:
    return [
        plot_throughput_latency(report, output_dir / "throughput_vs_latency.png"),
        plot_latency_cdfs(report, output_dir / "latency_cdf.png"),
        plot_timeline(report, output_dir / "occupancy_queue_timeline.png"),
    ]
