"""The report on disk: ``results.json`` (everything), ``results.md`` (tables) and the plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.records import BenchReport

JSON_NAME = "results.json"
MARKDOWN_NAME = "results.md"


def _q(values: dict[str, float | None]) -> str:
    return " / ".join("–" if values.get(k) is None else f"{values[k]:.0f}" for k in ("p50", "p95", "p99"))


def _num(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _lanes(summary: dict[str, Any]) -> str:
    return ", ".join(f"{lane} {_num(q['p50'], 0)}/{_num(q['p99'], 0)}" for lane, q in summary["queue_wait_ms"].items())


def runs_table(summaries: list[dict[str, Any]]) -> str:
    head = ("| workload | mode | system | rate | req/s | out tok/s | TTFT ms p50/p95/p99 | ITL ms p50/p95/p99 "
            "| E2E ms p50/p95/p99 | queue wait ms p50/p99 | occupancy | padding | KV mean/max | preempt |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summaries:
        kv = "–" if s["kv_usage_mean"] is None else f"{s['kv_usage_mean']:.2f}/{s['kv_usage_max']:.2f}"
        lines.append(
            f"| {s['workload']} | {s['mode']} | {s['system']} | {s.get('rate', '–')} | {s['requests_per_s']:.2f} "
            f"| {s['output_tokens_per_s']:.1f} | {_q(s['ttft_ms'])} | {_q(s['itl_ms'])} | {_q(s['e2e_ms'])} "
            f"| {_lanes(s)} | {_num(s['batch_occupancy'])} | {_num(s['padding_share'])} | {kv} | {s['preemptions']} |"
        )
    return "\n".join(lines)


def checks_table(checks: list[dict[str, Any]]) -> str:
    lines = ["| claim | target | measured | met | detail |", "|---|---|---|---|---|"]
    for c in checks:
        detail = ", ".join(f"{k} {v}" for k, v in c.items() if k not in ("name", "target", "measured", "passed"))
        met = "–" if c["passed"] is None else ("yes" if c["passed"] else "**no**")
        lines.append(f"| {c['name']} | {c['target']} | {_num(c['measured'], 3)} | {met} | {detail} |")
    return "\n".join(lines)


def machine_line(machine: dict[str, Any]) -> str:
    gpu = machine.get("gpu") or "no GPU"
    return (f"{machine['cpu']}, {machine['num_cpus']} CPUs ({machine['torch_threads']} torch threads), {gpu}; "
            f"{machine['platform']}; Python {machine['python']}, torch {machine['torch']}, "
            f"transformers {machine['transformers']}; load average at start {machine['load_average_at_start']}, "
            f"at end {machine.get('load_average_at_end')}")


def to_markdown(report: BenchReport, plots: list[str]) -> str:
    parts = [
        "# carpool bench results", "",
        f"Machine: {machine_line(report.machine)}.", "",
        f"Model: `{report.config['model']}`; max_num_seqs {report.config['max_num_seqs']}, seed {report.config['seed']}; "
        f"whole run {report.duration_s:.0f} s.", "",
        "## Claims", "", checks_table(report.checks), "",
    ]
    if report.peer_errors:
        parts += ["## Peers that could not run", ""]
        parts += [f"- `{name}`: {error}" for name, error in report.peer_errors.items()] + [""]
    parts += ["## Runs", "", runs_table(report.summaries()), ""]
    if plots:
        parts += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(parts)


def write_report(report: BenchReport, output_dir: Path) -> dict[str, Path]:
    from bench.plots import write_plots

    output_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(report, output_dir)
    document = {
        "machine": report.machine,
        "config": report.config,
        "duration_s": round(report.duration_s, 2),
        "checks": report.checks,
        "peer_errors": report.peer_errors,
        "repeats": report.repeats,
        "runs": report.summaries(),
        "plots": [p.name for p in plots],
    }
    json_path = output_dir / JSON_NAME
    json_path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    md_path = output_dir / MARKDOWN_NAME
    md_path.write_text(to_markdown(report, [str(p) for p in plots]))
    return {"json": json_path, "markdown": md_path, **{p.stem: p for p in plots}}
