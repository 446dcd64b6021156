"""Time the sampler alone: a batch of decode rows over a large vocabulary, step after step.

    python -m bench.sampler_speed [--device cuda] [--batch 32] [--vocab 32000 128000] [--steps 20]
                                  [--race-kernel auto|on|off]

Each workload runs `--steps` steps (after 3 of warm-up) of one Sampler over
fixed random logits, appending each sampled token to its request as the
engine does, and prints the median and best wall time of a step, and the
median CPU time of this process per step (the host's cost, which on a shared
machine varies less than the wall time).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from typing import Any

import torch

from scheduler.params import SamplingParams
from worker.engine.sampler import SampleRequest, Sampler

WORKLOADS: dict[str, dict[str, Any]] = {
    "unseeded T=1": {"temperature": 1.0, "seed": None},
    "seeded T=1": {"temperature": 1.0},
    "seeded T=1, top_p 0.9": {"temperature": 1.0, "top_p": 0.9},
    "seeded T=1, penalties": {"temperature": 1.0, "repetition_penalty": 1.1, "frequency_penalty": 0.2},
    "greedy": {"temperature": 0.0},
}
NUM_WARMUP_STEPS = 3


def time_workload(
    device: torch.device, batch: int, vocab: int, params: dict[str, Any], num_steps: int,
    race_kernel: bool | None = None,
) -> tuple[list[float], list[float]]:
    """Wall and process CPU seconds per `sample` call, synchronised, for `num_steps` steps after the warm-up."""
    rng = random.Random(0)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)).to(device)
    requests = [
        SampleRequest(
            f"r{i}", SamplingParams(**{"seed": i, **params}), [rng.randrange(vocab) for _ in range(200)],
            [rng.randrange(vocab) for _ in range(100)], 300, [],
        )
        for i in range(batch)
    ]
    sampler = Sampler(vocab, max_num_seqs=batch, device=device, seed=0, race_kernel=race_kernel)
    times: list[float] = []
    cpu_times: list[float] = []
    for step in range(NUM_WARMUP_STEPS + num_steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start, start_cpu = time.perf_counter(), time.process_time()
        tokens = sampler.sample(logits, requests)  # returns host values: the step is over
        if step >= NUM_WARMUP_STEPS:
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - start_cpu)
        for request, token in zip(requests, tokens):
            request.output_token_ids.append(token.token_id)
            request.position += 1
    return times, cpu_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128000])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--race-kernel", choices=["auto", "on", "off"], default="auto",
                        help="unseeded, unfiltered steps in one Triton kernel (auto: on CUDA, as the engine)")
    args = parser.parse_args()
    race_kernel = {"auto": None, "on": True, "off": False}[args.race_kernel]
    device = torch.device(args.device)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    )
    print(f"sampler, batch {args.batch}, {args.steps} steps per row; torch {torch.__version__} on {machine}")
    print(f"| {'vocab':>7} | {'workload':<22} | {'median ms':>9} | {'best ms':>8} | {'cpu ms':>7} |")
    print(f"|{'-' * 9}|{'-' * 24}|{'-' * 11}|{'-' * 10}|{'-' * 9}|")
    for vocab in args.vocab:
        for name, params in WORKLOADS.items():
            times, cpu_times = time_workload(device, args.batch, vocab, params, args.steps, race_kernel)
            print(
                f"| {vocab:>7} | {name:<22} | {statistics.median(times) * 1e3:>9.1f} | {min(times) * 1e3:>8.1f} "
                f"| {statistics.median(cpu_times) * 1e3:>7.1f} |"
            )


if __name__ == "__main__":
    main()
