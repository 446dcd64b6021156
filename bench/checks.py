"""The claims the benchmark settles, each as a measured number beside its target."""

from __future__ import annotations

import math
import statistics
from typing import Any

from bench.config import BenchConfig
from bench.records import BenchReport, summarize
from bench.speculative import PLAIN, PROMPT_LOOKUP, repeat_key
from bench.workloads import Workload, Workloads


def step_count_ceiling(workload: Workload, max_num_seqs: int) -> dict[str, float]:
    """Decode steps of a padded static batcher against a continuous one, when every step costs the same.

    Static runs each group of ``max_num_seqs`` (in arrival order) to its
    longest member. Continuous, while a backlog waits, keeps every slot
    busy: the total output over the slots (``packed``). A finite run also
    drains: first-come-first-served slot filling ends when its last slot
    empties (``fcfs``), which a late long request stretches. ``ratio`` is
    the steady-state bound (≈ 500 / 212.5 ≈ 2.35 for many large groups),
    ``ratio_whole_run`` the bound for this finite request list.
    """
    lens = [r.max_tokens for r in workload.requests]
    static_steps = sum(max(lens[i:i + max_num_seqs]) for i in range(0, len(lens), max_num_seqs))
    packed_steps = math.ceil(sum(lens) / max_num_seqs)
    slots_free_at = [0] * max_num_seqs
    for n in lens:
        slot = min(range(max_num_seqs), key=lambda i: slots_free_at[i])
        slots_free_at[slot] += n
    fcfs_steps = max(slots_free_at)
    return {"static_steps": static_steps, "packed_steps": packed_steps, "fcfs_steps": fcfs_steps,
            "ratio": round(static_steps / packed_steps, 3), "ratio_whole_run": round(static_steps / fcfs_steps, 3)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 3)


def _pair_ratios(pairs: list[dict[str, float | None]], numerator: str, denominator: str) -> list[float]:
    ratios = [_ratio(pair.get(numerator), pair.get(denominator)) for pair in pairs]
    return [r for r in ratios if r is not None]


def _median(values: list[float]) -> float | None:
    """The median of the measured pairs: one slow stretch of a shared machine moves it less than a mean."""
    return round(statistics.median(values), 3) if values else None


def _check(name: str, target: str, measured: float | None, passed: bool | None, **detail: Any) -> dict[str, Any]:
    return {"name": name, "target": target, "measured": measured, "passed": passed, **detail}


def evaluate_checks(report: BenchReport, w: Workloads, config: BenchConfig) -> list[dict[str, Any]]:
    def tput(workload: str, mode: str, system: str, rate: str | None = None) -> float | None:
        run = report.find(workload, mode, system, rate)
        return None if run is None else summarize(run)["output_tokens_per_s"]

    checks = []
    ceiling = step_count_ceiling(w.skewed, config.max_num_seqs)
    static, continuous = report.find("skewed", "offline", "static"), report.find("skewed", "offline", "continuous")
    skewed_pairs = [] if static is None or continuous is None else [
        {"static": summarize(static)["saturated_output_tokens_per_s"],
         "continuous": summarize(continuous)["saturated_output_tokens_per_s"]}]
    skewed_ratios = _pair_ratios(skewed_pairs + report.repeats.get("skewed", []), "continuous", "static")
    saturated = _median(skewed_ratios)
    checks.append(_check(
        "skewed: continuous / static output tokens/s while a backlog waits", ">= 2.0", saturated,
        None if saturated is None else saturated >= 2.0, pair_ratios=skewed_ratios, step_count_ceiling=ceiling["ratio"],
        whole_run_ratio=_ratio(tput("skewed", "offline", "continuous"), tput("skewed", "offline", "static")),
        whole_run_step_ceiling=ceiling["ratio_whole_run"],
        measured_step_ratio=None if static is None or continuous is None else _ratio(static.num_steps, continuous.num_steps),
    ))

    online_pairs = [{"online": tput("sharegpt-like", "online", "continuous", "saturation"),
                     "offline": tput("sharegpt-like", "offline", "continuous")}]
    online_ratios = _pair_ratios(online_pairs + report.repeats.get("online", []), "online", "offline")
    share = _median(online_ratios)
    checks.append(_check("online at saturation / offline output tokens/s (continuous, sharegpt-like)", ">= 0.85",
                         share, None if share is None else share >= 0.85, pair_ratios=online_ratios))

    cached = report.find("shared-prefix", "offline", "continuous, prefix cache")
    uncached = report.find("shared-prefix", "offline", "continuous, no prefix cache")
    cut = None
    if cached is not None and uncached is not None:
        cut = _ratio(summarize(uncached)["ttft_ms"]["p50"], summarize(cached)["ttft_ms"]["p50"])
    checks.append(_check("shared-prefix: TTFT p50 without / with prefix cache", ">= 3.0", cut,
                         None if cut is None else cut >= 3.0,
                         prefix_cache_hit_tokens=None if cached is None else cached.extra.get("prefix_cache_hit_tokens")))

    alone = report.find(w.mixed_alone.name, "offline", "continuous, priority")
    mixed = report.find(w.mixed_with_batch.name, "offline", "continuous, priority")
    growth = None
    if alone is not None and mixed is not None:
        growth = _ratio(summarize(mixed)["ttft_ms_by_lane"]["interactive"]["p99"],
                        summarize(alone)["ttft_ms_by_lane"]["interactive"]["p99"])
    checks.append(_check("mixed-lanes: interactive TTFT p99 with / without batch traffic", "<= 2.0", growth,
                         None if growth is None else growth <= 2.0))
    for workload, target, holds in ((w.repetitive, ">= 1.5", lambda r: r >= 1.5),
                                    (w.skewed, ">= 0.95", lambda r: r >= 0.95)):
        ratios = _pair_ratios(report.repeats.get(repeat_key(workload), []), PROMPT_LOOKUP, PLAIN)
        median = _median(ratios)
        checks.append(_check(f"{workload.name}: output tokens/s with / without prompt lookup (continuous)", target,
                             median, None if median is None else holds(median), pair_ratios=ratios))
    return checks
