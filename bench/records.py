"""What one benchmark run measured, and its summary statistics.

Every run, whichever way it was driven (engine direct, through the queue, or
a transformers peer), is reduced to per-request timings plus a time series of
the engine's state, so one summary function reports them all alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestTiming:
    lane: str
    arrival_s: float
    """Seconds from the start of the run."""
    num_output_tokens: int = 0
    admitted_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    token_gaps_s: list[float] = field(default_factory=list)
    """Time between consecutive output tokens (inter-token latency samples)."""


@dataclass
class Sample:
    """The engine's state after one step."""

    t_s: float
    num_running: int
    num_padding: int
    num_waiting: int
    kv_usage: float | None
    """Share of KV blocks in use; None where the run cannot see the engine."""


@dataclass
class RunResult:
    workload: str
    mode: str
    """offline, online or peer."""
    system: str
    """The batching mode or peer name."""
    duration_s: float
    requests: list[RequestTiming]
    max_num_seqs: int
    timeline: list[Sample] = field(default_factory=list)
    num_preemptions: int = 0
    num_steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.workload} / {self.mode} / {self.system}"


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _quantiles_ms(values: list[float]) -> dict[str, float | None]:
    out = {}
    for q in (50, 95, 99):
        v = percentile(values, q)
        out[f"p{q}"] = None if v is None else round(v * 1000.0, 3)
    return out


def token_times(timing: RequestTiming) -> list[float]:
    if timing.first_token_s is None:
        return []
    times = [timing.first_token_s]
    for gap in timing.token_gaps_s:
        times.append(times[-1] + gap)
    return times


def saturated_tokens_per_s(run: RunResult) -> float | None:
    """Output tokens/s while requests were still waiting to be admitted: the steady state of a backlog.

    The window runs from the start to the last admission; it leaves out the
    drain at the end, when nothing is left to fill freed slots, whose length
    depends on how long the last admitted requests happen to be.
    """
    admitted = [r.admitted_s for r in run.requests if r.admitted_s is not None]
    if not admitted or max(admitted) <= 0:
        return None
    end = max(admitted)
    num_tokens = sum(1 for r in run.requests for t in token_times(r) if t <= end)
    return round(num_tokens / end, 2)


def summarize(run: RunResult) -> dict[str, Any]:
    done = [r for r in run.requests if r.finished_s is not None]
    tokens = sum(r.num_output_tokens for r in done)
    duration = max(run.duration_s, 1e-9)
    lanes = sorted({r.lane for r in run.requests})
    occupancy = [(s.num_running / run.max_num_seqs) for s in run.timeline]
    kv = [s.kv_usage for s in run.timeline if s.kv_usage is not None]
    return {
        "label": run.label,
        "workload": run.workload,
        "mode": run.mode,
        "system": run.system,
        "num_requests": len(run.requests),
        "num_finished": len(done),
        "duration_s": round(run.duration_s, 3),
        "requests_per_s": round(len(done) / duration, 4),
        "output_tokens_per_s": round(tokens / duration, 2),
        "num_output_tokens": tokens,
        "saturated_output_tokens_per_s": saturated_tokens_per_s(run),
        "ttft_ms": _quantiles_ms([r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]),
        "itl_ms": _quantiles_ms([g for r in done for g in r.token_gaps_s]),
        "e2e_ms": _quantiles_ms([r.finished_s - r.arrival_s for r in done if r.finished_s is not None]),
        "queue_wait_ms": {
            lane: _quantiles_ms([r.admitted_s - r.arrival_s for r in run.requests
                                 if r.lane == lane and r.admitted_s is not None])
            for lane in lanes
        },
        "ttft_ms_by_lane": {
            lane: _quantiles_ms([r.first_token_s - r.arrival_s for r in done
                                 if r.lane == lane and r.first_token_s is not None])
            for lane in lanes
        },
        "batch_occupancy": None if not occupancy else round(sum(occupancy) / len(occupancy), 4),
        "padding_share": None if not run.timeline else round(
            sum(s.num_padding for s in run.timeline)
            / max(1, sum(s.num_running + s.num_padding for s in run.timeline)), 4),
        "kv_usage_mean": None if not kv else round(sum(kv) / len(kv), 4),
        "kv_usage_max": None if not kv else round(max(kv), 4),
        "preemptions": run.num_preemptions,
        "num_steps": run.num_steps,
        **run.extra,
    }

@dataclass
class BenchReport:
    config: dict[str, Any]
    machine: dict[str, Any]
    runs: list[RunResult] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    peer_errors: dict[str, str] = field(default_factory=dict)
    repeats: dict[str, list[dict[str, float | None]]] = field(default_factory=dict)
    """Each throughput claim's two sides measured again (``BenchConfig.skewed_pairs``, ``online_pairs``): "skewed" pairs of
    saturated static / continuous tokens/s, "online" pairs of offline / online-at-saturation tokens/s."""
    duration_s: float = 0.0

    def summaries(self) -> list[dict[str, Any]]:
        return [summarize(run) for run in self.runs]

    def find(self, workload: str, mode: str, system: str, rate: str | None = None) -> RunResult | None:
        for run in self.runs:
            if (run.workload, run.mode, run.system) == (workload, mode, system) and (
                    rate is None or run.extra.get("rate") == rate):
                return run
        return None
