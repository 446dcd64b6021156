"""What a benchmark run measures: its workloads, built from the config, and the machine it runs on."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any

from bench.config import BenchConfig
from bench.repetitive import repetitive
from bench.workloads import Workload, Workloads, mixed_lanes, shared_prefix, sharegpt_like, skewed


def build_workloads(config: BenchConfig) -> Workloads:
    scale = config.output_scale
    return Workloads(
        skewed=skewed(config.skewed_requests, seed=config.seed, output_scale=scale),
        sharegpt=sharegpt(config, config.seed),
        shared_prefix=shared_prefix(config.shared_prefix_requests, prefix_len=config.shared_prefix_len,
                                    max_tokens=4, seed=config.seed),
        mixed_alone=mixed_lanes(config.mixed_interactive, config.mixed_batch, config.mixed_interactive_rate,
                                seed=config.seed, with_batch=False, output_scale=scale),
        mixed_with_batch=mixed_lanes(config.mixed_interactive, config.mixed_batch, config.mixed_interactive_rate,
                                     seed=config.seed, with_batch=True, output_scale=scale),
        repetitive=repetitive(config.repetitive_requests, seed=config.seed, max_tokens=config.repetitive_max_tokens),
    )


def sharegpt(config: BenchConfig, seed: int) -> Workload:
    return sharegpt_like(config.sharegpt_requests, seed=seed, max_output_len=max(4, round(256 * config.output_scale)))


def describe_machine() -> dict[str, Any]:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        cpu = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), cpu)
    except (OSError, subprocess.SubprocessError):
        pass  # lscpu is a nicety; platform's answer stands
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
