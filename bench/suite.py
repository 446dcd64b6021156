"""The whole comparison: every workload, batching mode, peer and arrival rate, in one seeded run."""

from __future__ import annotations

import asyncio
import gc
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from bench.checks import evaluate_checks
from bench.config import BenchConfig
from bench.offline import make_engine, run_offline
from bench.online import OnlineStack, run_online
from bench.plan import build_workloads, describe_machine, sharegpt
from bench.records import BenchReport, RunResult, saturated_tokens_per_s, summarize
from bench.speculative import run_speculative_pairs
from bench.workloads import Workload, Workloads, poisson_arrivals, skewed

Progress = Callable[[str, int], None]
"""``progress(phase, num_new_output_tokens)``."""




def planned_output_tokens(config: BenchConfig, w: Workloads) -> int:
    """Output tokens the whole run will produce, for the progress bar."""
    offline = len(config.modes) * (w.skewed.num_output_tokens + w.sharegpt.num_output_tokens)
    peers = 2 * w.skewed.num_output_tokens if config.peers else 0
    prefix = 2 * w.shared_prefix.num_output_tokens
    mixed = w.mixed_alone.num_output_tokens + w.mixed_with_batch.num_output_tokens
    online = len(config.online_modes) * len(config.online_rate_fractions) * w.sharegpt.num_output_tokens
    # Repeats: skewed on static and continuous; sharegpt-like offline and online (other seeds: about as long).
    repeats = 2 * ((config.skewed_pairs - 1) * w.skewed.num_output_tokens
                   + (config.online_pairs - 1) * w.sharegpt.num_output_tokens)
    speculative = 2 * config.speculative_pairs * (w.repetitive.num_output_tokens + w.skewed.num_output_tokens)
    return offline + peers + prefix + mixed + online + repeats + speculative


def run_suite(config: BenchConfig, model: str, progress: Progress, env: Mapping[str, str]) -> BenchReport:
    """``env`` is the environment the worker child starts with (its torch thread count is set from the config)."""
    import torch

    torch.set_num_threads(config.threads)
    child_env = {**env, "OMP_NUM_THREADS": str(config.threads)}
    started = time.perf_counter()
    w = build_workloads(config)
    report = BenchReport(config={**config.__dict__, "model": model}, machine=describe_machine())

    def tick(phase: str) -> Callable[[int], None]:
        return lambda n: progress(phase, n)

    for mode in config.modes:
        engine = _engine(config, model, mode, max_wait_ms=config.max_wait_ms)
        for workload in (w.skewed, w.sharegpt):
            report.runs.append(run_offline(engine, workload, mode, tick(f"offline {workload.name} {mode}")))
        del engine
        gc.collect()
    if "static" in config.modes:
        for _ in range(1, config.skewed_pairs):
            report.repeats.setdefault("skewed", []).append(_skewed_pair(config, model, w.skewed, tick))

    if config.peers:
        _run_peers(config, model, w, report, tick)

    for system, caching in (("continuous, prefix cache", True), ("continuous, no prefix cache", False)):
        engine = _engine(config, model, "continuous", enable_prefix_caching=caching)
        report.runs.append(_run_one_at_a_time(engine, w.shared_prefix, system, tick(f"shared-prefix {system}")))
        del engine

    engine = _engine(config, model, "continuous", policy="priority")
    for workload in (w.mixed_alone, w.mixed_with_batch):
        report.runs.append(run_offline(engine, workload, "continuous, priority", tick(f"{workload.name}")))
    del engine
    gc.collect()

    run_speculative_pairs(config, model, [w.repetitive, w.skewed], report, tick)

    asyncio.run(_run_online_sweeps(config, model, w.sharegpt, report, tick, child_env))

    report.machine["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    report.duration_s = time.perf_counter() - started

    report.checks = evaluate_checks(report, w, config)
    return report


def _engine(config: BenchConfig, model: str, batching: str, **engine_kwargs: Any) -> Any:
    """A warmed-up engine with the run's slots, device and dtype."""
    return make_engine(model, batching, config.max_num_seqs, device=config.device, dtype=config.dtype,
                       **engine_kwargs)


def _run_peers(config: BenchConfig, model: str, w: Workloads, report: BenchReport,
               tick: Callable[[str], Callable[[int], None]]) -> None:
    from bench.peers import load_hf_model, run_hf_generate, run_hf_generate_batch

    hf_model, tokenizer = load_hf_model(model, config.device, config.dtype)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # Warm-up: one short padded batch through each path.
    warm = skewed(2, seed=config.seed + 99, output_scale=0.02)
    run_hf_generate(hf_model, pad_id, warm, config.max_num_seqs)
    # The peers run the skewed workload only: that is where padding costs, and it keeps the run short.
    report.runs.append(run_hf_generate(hf_model, pad_id, w.skewed, config.max_num_seqs, tick("peer hf-generate")))
    try:
        run_hf_generate_batch(hf_model, warm, config.max_num_seqs)
        report.runs.append(run_hf_generate_batch(hf_model, w.skewed, config.max_num_seqs,
                                                 tick("peer hf-generate-batch")))
    except Exception as e:  # any failure of the peer is reported, not fatal to the comparison
        report.peer_errors["hf-generate-batch"] = f"{type(e).__name__}: {e}"


def _skewed_pair(config: BenchConfig, model: str, workload: Workload,
                 tick: Callable[[str], Callable[[int], None]]) -> dict[str, float | None]:
    """Static then continuous on ``workload`` again, each on a fresh engine (no prefix cache from the first run)."""
    pair: dict[str, float | None] = {}
    for mode in ("static", "continuous"):
        engine = _engine(config, model, mode, max_wait_ms=config.max_wait_ms)
        pair[mode] = saturated_tokens_per_s(run_offline(engine, workload, mode, tick(f"repeat skewed {mode}")))
        del engine
        gc.collect()
    return pair


def _run_one_at_a_time(engine: Any, workload: Workload, system: str, on_token: Callable[[int], None]) -> RunResult:
    """Each request alone, so TTFT is the prefill itself with no queueing behind the others."""
    runs = [run_offline(engine, Workload(workload.name, [r]), system, on_token) for r in workload.requests]
    merged = runs[0]
    for run in runs[1:]:
        merged.requests += run.requests
        merged.timeline += run.timeline
        merged.duration_s += run.duration_s
        merged.num_steps += run.num_steps
    merged.extra = {"prefix_cache_hit_tokens": runs[-1].extra.get("prefix_cache_hit_tokens", 0)}
    return merged


async def _run_online_sweeps(config: BenchConfig, model: str, workload: Workload, report: BenchReport,
                             tick: Callable[[str], Callable[[int], None]], child_env: Mapping[str, str]) -> None:
    """Each mode at saturation first; continuous's saturated request rate sets the sweep's rates for all modes."""
    capacity_rps: float | None = None
    fractions = sorted(config.online_rate_fractions, key=lambda f: not math.isinf(f))
    for mode in sorted(config.online_modes, key=lambda m: m != "continuous"):
        async with OnlineStack(model, mode, config.max_num_seqs, config.max_wait_ms, child_env,
                               device=config.device, dtype=config.dtype) as stack:
            # Warm-up through the whole path before timing anything.
            await run_online(stack, Workload("warm-up", workload.requests[:2]), "warm-up")
            for fraction in fractions:
                if math.isinf(fraction):
                    rate, label = math.inf, "saturation"
                else:
                    if capacity_rps is None:  # no saturation point asked for: offline continuous stands in
                        offline = report.find(workload.name, "offline", "continuous")
                        assert offline is not None
                        capacity_rps = summarize(offline)["requests_per_s"]
                    rate, label = fraction * capacity_rps, f"{fraction:g}x"
                timed = poisson_arrivals(workload, rate, seed=config.seed)
                run = await run_online(stack, timed, label, tick(f"online {mode} {label}"))
                run.extra["rate_per_s"] = None if math.isinf(rate) else round(rate, 4)
                if capacity_rps is None and mode == "continuous" and math.isinf(rate):
                    capacity_rps = summarize(run)["requests_per_s"]
                report.runs.append(run)
            if mode == "continuous" and any(math.isinf(f) for f in fractions):
                for k in range(1, config.online_pairs):
                    pair = await _online_pair(config, model, stack, sharegpt(config, config.seed + k), tick)
                    report.repeats.setdefault("online", []).append(pair)


async def _online_pair(config: BenchConfig, model: str, stack: OnlineStack, workload: Workload,
                       tick: Callable[[str], Callable[[int], None]]) -> dict[str, float | None]:
    """Offline (a fresh engine, on a thread) then online at saturation, back to back, on one new workload."""
    def offline() -> float:
        engine = _engine(config, model, "continuous", max_wait_ms=config.max_wait_ms)
        run = run_offline(engine, workload, "continuous", tick(f"repeat {workload.name} offline"))
        return float(summarize(run)["output_tokens_per_s"])

    offline_tps = await asyncio.to_thread(offline)
    gc.collect()
    online = await run_online(stack, poisson_arrivals(workload, math.inf), "saturation",
                              tick(f"repeat {workload.name} online"))
    return {"offline": offline_tps, "online": summarize(online)["output_tokens_per_s"]}
