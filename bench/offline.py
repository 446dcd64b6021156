"""Engine-direct runs: requests enter ``Engine.add_request`` at their arrival times, one step at a time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bench.records import RequestTiming, RunResult, Sample
from bench.workloads import BenchRequest, Workload
from scheduler.params import SamplingParams

WARMUP_MAX_TOKENS = 8


def make_engine(model: str, batching: str, max_num_seqs: int, max_wait_ms: float = 20.0, **engine_kwargs: Any) -> Any:
    """An engine, warmed up with a small batch so the first timed step pays no first-call costs."""
    from worker.engine.engine import Engine
    from worker.engine.startup_heap import freeze_startup_heap

    engine = Engine(model=model, batching=batching, max_num_seqs=max_num_seqs, max_wait_ms=max_wait_ms,
                    **engine_kwargs)
    freeze_startup_heap()  # as a worker's engine process does once its engine is built
    warm = [[65 + i] * 16 for i in range(min(4, max_num_seqs))]
    engine.generate(warm, SamplingParams(max_tokens=WARMUP_MAX_TOKENS, ignore_eos=True))
    return engine


def _params(request: BenchRequest) -> SamplingParams:
    return SamplingParams(max_tokens=request.max_tokens, ignore_eos=True, temperature=request.temperature)


def run_offline(engine: Any, workload: Workload, system: str,
                on_token: Callable[[int], None] | None = None) -> RunResult:
    """Drive ``engine`` through ``workload``; ``on_token(n)`` reports progress in output tokens."""
    requests = sorted(workload.requests, key=lambda r: r.arrival_s)
    timings: dict[str, RequestTiming] = {}
    last_token_s: dict[str, float] = {}
    not_admitted: set[str] = set()
    timeline: list[Sample] = []
    preemptions_before = engine.stats().num_preemptions
    steps_before = engine.stats().num_steps
    next_index = 0
    start = time.perf_counter()
    while next_index < len(requests) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while next_index < len(requests) and requests[next_index].arrival_s <= now:
            r = requests[next_index]
            rid = f"{workload.name}-{next_index}"
            engine.add_request(rid, r.prompt_token_ids, _params(r), priority=r.priority)
            timings[rid] = RequestTiming(lane=r.lane, arrival_s=r.arrival_s)
            not_admitted.add(rid)
            next_index += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, requests[next_index].arrival_s - now))
            continue
        step_start = time.perf_counter() - start
        outputs = engine.step()
        t = time.perf_counter() - start
        if not_admitted:
            for seq in engine.scheduler.running:
                if seq.request_id in not_admitted:
                    timings[seq.request_id].admitted_s = step_start
                    not_admitted.discard(seq.request_id)
        num_new = 0
        for out in outputs:
            timing = timings[out.request_id]
            if out.new_token_ids:
                if timing.first_token_s is None:
                    timing.first_token_s = t
                    timing.admitted_s = timing.admitted_s if timing.admitted_s is not None else step_start
                    not_admitted.discard(out.request_id)
                else:
                    timing.token_gaps_s.append(t - last_token_s[out.request_id])
                last_token_s[out.request_id] = t
                timing.num_output_tokens += len(out.new_token_ids)
                num_new += len(out.new_token_ids)
            if out.finished:
                timing.finished_s = t
        stats = engine.stats()
        padding = sum(1 for s in engine.scheduler.running if s.is_padding)
        timeline.append(Sample(t, stats.num_running, padding, stats.num_waiting, stats.kv_usage))
        if on_token is not None and num_new:
            on_token(num_new)
        if stats.last_step_num_seqs == 0 and not outputs:
            time.sleep(0.001)  # dynamic batching is holding a group back
    stats = engine.stats()
    return RunResult(
        workload=workload.name, mode="offline", system=system, duration_s=time.perf_counter() - start,
        requests=list(timings.values()), max_num_seqs=engine.max_num_seqs, timeline=timeline,
        num_preemptions=stats.num_preemptions - preemptions_before, num_steps=stats.num_steps - steps_before,
        extra={"prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens},
    )
