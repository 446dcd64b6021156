"""Where the host's share of a decode step goes: each part of `Engine.step` timed by the host's clock.

    python -m bench.host_phases --model PATH [--device cuda] [--dtype bfloat16] [--batches 8,32,128]
    python -m bench.host_phases --device cpu --model PATH --dtype float32 --batches 32,128 --async-scheduling

Fills an engine with `batch` decoding requests (as `bench.step_profile` does; on CUDA its decode steps replay
graphs), then times `--steps` steps with a clock around each part of a step: the schedule, the input staging
and the forward's launch (`ModelRunner.execute`: on a CPU the forward itself), the sampler's launch (on a CPU
its arithmetic too), the scheduler's advance, the wait for the device's tokens (the event `Sampler.collect`
waits on; 0 on a CPU), the rest of reading them, and the stop checks and detokenization (`_postprocess`);
`other` is the step's wall time less all of these. On CUDA, where the engine schedules ahead, a step whose
wait is near 0 is bound by the host: the parts are what to cut. A long wait means the device is the bound.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bench.config import MODEL_DTYPES
from bench.step_profile import _filled_engine, freeze_imported_heap

PHASES = ("schedule", "execute", "draw", "advance", "wait", "read", "postprocess", "other")
TABLE_HEADER = ("| batch | step ms | " + " | ".join(f"{phase} ms" for phase in PHASES) + " |\n"
                + "|---" * (len(PHASES) + 2) + "|")


@dataclass(frozen=True)
class HostPhases:
    batch: int
    step_ms: float
    phase_ms: dict[str, float]
    """Milliseconds per step of each of PHASES."""


def _timed(totals: defaultdict[str, float], phase: str, call: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            totals[phase] += time.perf_counter() - start
    return run


def _collect_timing_the_wait(totals: defaultdict[str, float], collect: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def run(drawn: Any) -> Any:
        start = time.perf_counter()
        if drawn.copied is not None:
            drawn.copied.synchronize()  # the wait itself; `collect`'s own wait then returns at once
        waited = time.perf_counter()
        try:
            return collect(drawn)
        finally:
            totals["wait"] += waited - start
            totals["read"] += time.perf_counter() - waited
    return run


def measure(engine: Any, steps: int, batch: int) -> HostPhases:
    """Time `steps` steps of `engine` (already decoding `batch` requests) part by part."""
    totals: defaultdict[str, float] = defaultdict(float)
    scheduler, runner, sampler = engine.scheduler, engine.runner, engine.sampler
    # Instance attributes shadow the methods for this engine only.
    scheduler.schedule = _timed(totals, "schedule", scheduler.schedule)
    runner.execute = _timed(totals, "execute", runner.execute)
    sampler.launch = _timed(totals, "draw", sampler.launch)
    scheduler.advance_launched = _timed(totals, "advance", scheduler.advance_launched)
    scheduler.advance = _timed(totals, "advance", scheduler.advance)
    sampler.collect = _collect_timing_the_wait(totals, sampler.collect)
    engine._postprocess = _timed(totals, "postprocess", engine._postprocess)
    is_cuda = engine.runner.device.type == "cuda"
    if is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall_s = time.perf_counter() - start
    totals["other"] = wall_s - sum(totals.values())
    return HostPhases(batch=batch, step_ms=1e3 * wall_s / steps,
                      phase_ms={phase: 1e3 * totals[phase] / steps for phase in PHASES})


def host_phases(model: str, device: str, dtype: str, batch: int, steps: int = 100,
                async_scheduling: bool | None = None) -> HostPhases:
    """An engine of `batch` decoding requests (graphs on CUDA, as the engine's default), measured;
    `async_scheduling` as the engine's (None: its default, on for CUDA)."""
    engine = _filled_engine(model, device, dtype, batch, "auto", None, cuda_graphs=device.startswith("cuda"),
                            async_scheduling=async_scheduling)
    return measure(engine, steps, batch)


def table_row(r: HostPhases) -> str:
    return f"| {r.batch} | {r.step_ms:.2f} | " + " | ".join(f"{r.phase_ms[p]:.2f}" for p in PHASES) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=MODEL_DTYPES)
    parser.add_argument("--batches", default="8,32,128")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="the engine's async scheduling (scheduling ahead); default: the engine's, on for CUDA")
    args = parser.parse_args()
    freeze_imported_heap()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench.host_phases --device cuda needs a CUDA device; none is available here (try --device cpu).")
    if args.device == "cpu":
        torch.set_num_threads(1)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU, 1 torch thread"
    print(f"device: {name}; model {args.model}, {args.dtype}\n\n{TABLE_HEADER}")
    for batch in (int(b) for b in args.batches.split(",")):
        print(table_row(host_phases(args.model, args.device, args.dtype, batch, args.steps, args.async_scheduling)),
              flush=True)


if __name__ == "__main__":
    main()
