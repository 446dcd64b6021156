"""The claims the benchmark settles, each as a measured number beside its target."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from bench.config import BenchConfig
from bench.records import summarize
from bench.workloads import Workload

if TYPE_CHECKING:
    from bench.suite import BenchReport, Workloads


def step_count_ceiling(workload: Workload, max_num_seqs: int) -> dict[str, float]:
    """Decode steps a padded static batcher needs against a perfectly packed continuous one.

    Static runs each group of ``max_num_seqs`` (in arrival order) to its
    longest member; continuous at best keeps every slot busy, so it needs
    the total output over the slots. Their ratio bounds the throughput gain
    when a step costs the same whatever the batch holds.
    """
    lens = [r.max_tokens for r in workload.requests]
    static_steps = sum(max(lens[i:i + max_num_seqs]) for i in range(0, len(lens), max_num_seqs))
    # Continuous cannot beat the longest request either.
    continuous_steps = max(math.ceil(sum(lens) / max_num_seqs), max(lens))
    return {"static_steps": static_steps, "continuous_steps": continuous_steps,
            "ratio": round(static_steps / continuous_steps, 3)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 3)


def _check(name: str, target: str, measured: float | None, passed: bool | None, **detail: Any) -> dict[str, Any]:
    return {"name": name, "target": target, "measured": measured, "passed": passed, **detail}


def evaluate_checks(report: BenchReport, w: Workloads, config: BenchConfig) -> list[dict[str, Any]]:
    def tput(workload: str, mode: str, system: str, rate: str | None = None) -> float | None:
        run = report.find(workload, mode, system, rate)
        return None if run is None else summarize(run)["output_tokens_per_s"]

    checks = []
    ceiling = step_count_ceiling(w.skewed, config.max_num_seqs)
    static, continuous = report.find("skewed", "offline", "static"), report.find("skewed", "offline", "continuous")
    speedup = _ratio(tput("skewed", "offline", "continuous"), tput("skewed", "offline", "static"))
    checks.append(_check(
        "skewed: continuous / static output tokens/s", ">= 2.0", speedup,
        None if speedup is None else speedup >= 2.0, step_count_ceiling=ceiling["ratio"],
        measured_step_ratio=None if static is None or continuous is None else _ratio(static.num_steps, continuous.num_steps),
    ))

    online = tput("sharegpt-like", "online", "continuous", "saturation")
    share = _ratio(online, tput("sharegpt-like", "offline", "continuous"))
    checks.append(_check("online at saturation / offline output tokens/s (continuous, sharegpt-like)", ">= 0.85",
                         share, None if share is None else share >= 0.85))

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
    return checks
