"""Where a decode step's time goes on a CUDA GPU: host wall time against summed kernel time.

    python -m bench.step_profile --model PATH [--dtype bfloat16] [--batches 8,32]

For each batch size, fills the engine with that many decoding requests, times 100 steps
(wall clock; each step ends with its sampled tokens on the host), then profiles 20 more and
reports the GPU kernel time and the number of kernel launches per step. A step whose wall
time is far above its kernel time is bound by the host (Python and launches), not the GPU.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.config import MODEL_DTYPES
from scheduler.params import SamplingParams

LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def profile_batch(model: str, device: str, dtype: str, batch: int, timed_steps: int = 100) -> str:
    from worker import Engine

    engine = Engine(model=model, device=device, dtype=dtype, max_num_seqs=batch)
    for i in range(batch):
        engine.add_request(f"r{i}", [65 + i % 20] * 32, SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(30):  # past the prefills, into steady decoding
        engine.step()
    start = time.perf_counter()
    for _ in range(timed_steps):
        engine.step()
    step_ms = 1e3 * (time.perf_counter() - start) / timed_steps
    profiled_steps = 20
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled_steps):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernel_ms = sum(e.self_device_time_total for e in events) / profiled_steps / 1e3
    launches = sum(e.count for e in events if e.key in LAUNCH_EVENTS) / profiled_steps
    return (f"| {batch} | {step_ms:.2f} | {kernel_ms:.2f} | {launches:.0f} |\n"
            + events.table(sort_by="self_device_time_total", row_limit=8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=MODEL_DTYPES)
    parser.add_argument("--batches", default="8,32")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.step_profile profiles GPU steps and needs a CUDA device; none is available here.")
    print(f"device: {torch.cuda.get_device_name()}; model {args.model}, {args.dtype}\n")
    print("| batch | step wall ms | GPU kernel ms | kernel launches |\n|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        print(profile_batch(args.model, args.device, args.dtype, batch))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
