"""Where a decode step's time goes on a CUDA GPU: host wall time against GPU kernel time.

    python -m bench.step_profile --model PATH [--dtype bfloat16] [--batches 1,8,32,128] [--modes eager,graphs]

For each mode and batch size, fills the engine with that many decoding requests, times 100
steps (wall clock; each step ends with its sampled tokens on the host), then profiles 20 more.
GPU time counts kernel rows only (each kernel once, by its own start and end on the device),
and the busy share is the union of kernel intervals over the profiled steps' wall time. A step
whose wall time is far above its kernel time is bound by the host (Python and launches).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench.config import MODEL_DTYPES
from scheduler.params import SamplingParams

# Host calls that put work on the GPU: one per kernel launched eagerly, one per graph replayed.
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")
MODES = ("eager", "graphs")


@dataclass(frozen=True)
class StepProfile:
    mode: str
    batch: int
    step_ms: float
    kernel_ms: float
    busy_share: float
    num_kernels: float
    num_launches: float
    top_kernels: str


def _merged_length_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total = 0.0
    current: tuple[float, float] | None = None
    for start, end in sorted(intervals):
        if current is not None and start <= current[1]:
            current = (current[0], max(current[1], end))
            continue
        if current is not None:
            total += current[1] - current[0]
        current = (start, end)
    if current is not None:
        total += current[1] - current[0]
    return total


def profile_batch(model: str, device: str, dtype: str, batch: int, mode: str, timed_steps: int = 100) -> StepProfile:
    from worker import Engine

    engine = Engine(model=model, device=device, dtype=dtype, max_num_seqs=batch, cuda_graphs=mode == "graphs")
    assert mode == "eager" or engine.runner.graph_sizes, "CUDA graphs were asked for but not recorded (see the log)"
    for i in range(batch):
        engine.add_request(f"r{i}", [65 + i % 20] * 32, SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(30):  # past the prefills, into steady decoding
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(timed_steps):
        engine.step()
    step_ms = 1e3 * (time.perf_counter() - start) / timed_steps
    profiled_steps = 20
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        wall_start = time.perf_counter()
        for _ in range(profiled_steps):
            engine.step()
        torch.cuda.synchronize()
        profiled_wall_us = 1e6 * (time.perf_counter() - wall_start)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    kernel_us = sum(end - start for start, end in intervals)
    busy_us = _merged_length_us(intervals)
    launches = sum(1 for e in prof.events() if e.name in LAUNCH_EVENTS)
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=8)
    return StepProfile(
        mode=mode, batch=batch, step_ms=step_ms, kernel_ms=kernel_us / profiled_steps / 1e3,
        busy_share=busy_us / profiled_wall_us, num_kernels=len(kernels) / profiled_steps,
        num_launches=launches / profiled_steps, top_kernels=table,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=MODEL_DTYPES)
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--modes", default=",".join(MODES), help="eager, graphs (decode steps replayed as CUDA graphs)")
    parser.add_argument("--tables", action="store_true", help="also print each run's top kernels")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.step_profile profiles GPU steps and needs a CUDA device; none is available here.")
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        sys.exit(f"--modes: unknown {sorted(unknown)}; modes are {', '.join(MODES)}")
    print(f"device: {torch.cuda.get_device_name()}; model {args.model}, {args.dtype}\n")
    rows = []
    for mode in modes:
        for batch in (int(b) for b in args.batches.split(",")):
            result = profile_batch(args.model, args.device, args.dtype, batch, mode)
            rows.append(result)
            if args.tables:
                print(f"## {mode}, batch {batch}\n{result.top_kernels}")
            torch.cuda.empty_cache()
    print("| mode | batch | step wall ms | GPU kernel ms | GPU busy | kernels/step | launches/step |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.mode} | {r.batch} | {r.step_ms:.2f} | {r.kernel_ms:.2f} | {100 * r.busy_share:.0f} % "
              f"| {r.num_kernels:.0f} | {r.num_launches:.0f} |")


if __name__ == "__main__":
    main()
