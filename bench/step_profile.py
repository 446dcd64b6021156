"""Where a decode step's time goes: host wall time against GPU kernel time.

    python -m bench.step_profile --model PATH [--dtype bfloat16] [--batches 1,8,32,128] [--modes eager,graphs]
    python -m bench.step_profile --device cpu --model PATH --dtype float32 --model-impls carpool,transformers
    python -m bench.step_profile --device cpu --model PATH --dtype float32 --quantization int8
    python -m bench.step_profile --device cpu --model PATH --dtype float32 --model-impls carpool,transformers \
        --alternate 25

On CPU it reports the wall time only (graphs are CUDA's), for each model implementation asked for.
With `--alternate ROUNDS` (CPU) every implementation's engine is built first, then they are stepped in
turns, 20 steps each per round, and the fastest round of each is reported: on a machine whose speed
drifts from minute to minute, both sides of the comparison then see the same minutes.

For each mode and batch size, fills the engine with that many decoding requests, times 100
steps (wall clock; each step ends with its sampled tokens on the host), then profiles 20 more.
GPU time counts kernel rows only (each kernel once, by its own start and end on the device),
and the busy share is the union of kernel intervals over the profiled steps' wall time. A step
whose wall time is far above its kernel time is bound by the host (Python and launches).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench.config import MODEL_DTYPES
from scheduler.params import SamplingParams
from worker.engine.startup_heap import freeze_startup_heap

# Host calls that put work on the GPU: one per kernel launched eagerly, one per graph replayed.
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")
# Pieces of the names of the kernels matrix products run on NVIDIA GPUs: cuBLAS's GEMM and GEMV kernels
# (`sm90_xmma_gemm_...`, `gemv2T_kernel_val`, `splitKreduce_kernel` of a split-K product), cuBLASLt's
# `nvjet_...`, CUTLASS's, and the quantized weights' Triton kernels (`kernels/decode_matmul.py`).
MATMUL_KERNEL_MARKERS = ("gemm", "gemv", "splitkreduce", "nvjet", "cutlass", "xmma", "decode_matmul")
MODES = ("eager", "graphs")


@dataclass(frozen=True)
class StepProfile:
    mode: str
    model_impl: str
    batch: int
    step_ms: float
    kernel_ms: float
    busy_share: float
    num_kernels: float
    num_launches: float
    top_kernels: str
    matmul_ms: float
    """GPU time a step spends in matrix-product kernels (`is_matmul_kernel`)."""
    matrix_bytes: float
    """Bytes of the matrices a step reads (carpool's own models; NaN for the transformers path)."""

    @property
    def matmul_gbps(self) -> float:
        """The rate the matrix products read their weights at: the floor of their traffic over their time; NaN
        where no kernel was told to be a matrix product (a naming this module does not know), not a division by 0."""
        return self.matrix_bytes / self.matmul_ms / 1e6 if self.matmul_ms > 0 else float("nan")


TABLE_HEADER = ("| model | mode | batch | step wall ms | GPU kernel ms | GPU busy | kernels/step | launches/step "
                "| matmul kernel ms | weights read at |\n|---|---|---|---|---|---|---|---|---|---|")


def table_row(r: StepProfile, peak_gbps: float | None = None) -> str:
    """`r` under `TABLE_HEADER`; the weights' read rate also as a share of `peak_gbps`, when given."""
    rate = "–" if math.isnan(r.matmul_gbps) else f"{r.matmul_gbps:,.0f} GB/s"
    if peak_gbps and not math.isnan(r.matmul_gbps):
        rate += f" ({100 * r.matmul_gbps / peak_gbps:.0f} %)"
    return (f"| {r.model_impl} | {r.mode} | {r.batch} | {r.step_ms:.2f} | {r.kernel_ms:.2f} | {100 * r.busy_share:.0f} % "
            f"| {r.num_kernels:.0f} | {r.num_launches:.0f} | {r.matmul_ms:.2f} | {rate} |")


def is_matmul_kernel(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in MATMUL_KERNEL_MARKERS)


def freeze_imported_heap() -> None:
    """The benchmark process's start-up heap frozen, as a worker's engine process freezes its own once the engine is
    built (`worker.engine.startup_heap`): the engine's modules are imported first, since they are nearly all of that
    heap (about 353,000 objects; an engine adds about a thousand)."""
    import worker.engine.engine  # noqa: F401

    freeze_startup_heap()


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


def _filled_engine(model: str, device: str, dtype: str, batch: int, model_impl: str, quantization: str | None,
                   cuda_graphs: bool = False, cpu_kernels: bool | None = None,
                   async_scheduling: bool | None = None, matmul_tuning: bool | None = None) -> Any:
    """An engine with `batch` requests of 32-token prompts, past their prefills and decoding."""
    from worker import Engine

    engine = Engine(model=model, device=device, dtype=dtype, max_num_seqs=batch, cuda_graphs=cuda_graphs,
                    model_impl=model_impl, quantization=quantization, cpu_kernels=cpu_kernels,
                    async_scheduling=async_scheduling, matmul_tuning=matmul_tuning)
    freeze_startup_heap()  # as a worker's engine process does once its engine is built
    for i in range(batch):
        engine.add_request(f"r{i}", [65 + i % 20] * 32, SamplingParams(max_tokens=2000, ignore_eos=True))
    # Past the prefills into steady decoding, then past the first decode steps' one-off work (pinned host blocks,
    # sampling rows), so that what is timed is the step a long-running worker takes.
    for _ in range(40):
        engine.step()
    return engine


def profile_batch(model: str, device: str, dtype: str, batch: int, mode: str, timed_steps: int = 100,
                  model_impl: str = "auto", quantization: str | None = None,
                  cpu_kernels: bool | None = None, matmul_tuning: bool | None = None) -> StepProfile:
    """`matmul_tuning`: the engine's (False: torch's matrix products only, the baseline of the timed choice)."""
    is_cuda = device.startswith("cuda")
    engine = _filled_engine(model, device, dtype, batch, model_impl, quantization, cuda_graphs=mode == "graphs",
                            cpu_kernels=cpu_kernels, matmul_tuning=matmul_tuning)
    assert mode == "eager" or engine.runner.graph_sizes, "CUDA graphs were asked for but not recorded (see the log)"
    impl = engine.runner.model_choice.impl.value
    if is_cuda and getattr(engine.runner.model, "use_kernels", True) is False:
        impl += " (fused kernels failed their start-up check: torch ops)"
    matmuls = getattr(engine.runner.model, "matmuls", None)
    if matmul_tuning is False:
        impl += ", torch's matmul"
    elif matmuls is not None and matmuls.plans:
        taken = sum(plan is not None for plan in matmuls.plans.values())
        impl += f", timed matmul ({taken} of {len(matmuls.plans)} kernel)"
        print("matrix products, carpool's kernel where timed faster:\n  " + "\n  ".join(matmuls.describe()),
              flush=True)
    matrix_bytes = float(getattr(engine.runner.model, "matrix_nbytes", float("nan")))
    if is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(timed_steps):
        engine.step()
    step_ms = 1e3 * (time.perf_counter() - start) / timed_steps
    if not is_cuda:
        return StepProfile(mode=mode, model_impl=impl, batch=batch, step_ms=step_ms, kernel_ms=float("nan"),
                           busy_share=float("nan"), num_kernels=float("nan"), num_launches=float("nan"),
                           top_kernels="", matmul_ms=float("nan"), matrix_bytes=matrix_bytes)
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
    # The products' time is the union of their kernels' intervals: a dependent launch starts while the kernel
    # before it ends (a product before it too), and its time before the wait counts once.
    matmul_us = _merged_length_us([(e.time_range.start, e.time_range.end) for e in kernels
                                   if is_matmul_kernel(e.name)])
    busy_us = _merged_length_us(intervals)
    launches = sum(1 for e in prof.events() if e.name in LAUNCH_EVENTS)
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=8)
    return StepProfile(
        mode=mode, model_impl=impl, batch=batch, step_ms=step_ms, kernel_ms=kernel_us / profiled_steps / 1e3,
        busy_share=busy_us / profiled_wall_us, num_kernels=len(kernels) / profiled_steps,
        num_launches=launches / profiled_steps, top_kernels=table, matmul_ms=matmul_us / profiled_steps / 1e3,
        matrix_bytes=matrix_bytes,
    )


def alternate_cpu(model: str, dtype: str, batch: int, impls: list[str], rounds: int,
                  quantization: str | None = None, steps_per_round: int = 20,
                  cpu_kernels: bool | None = None) -> dict[str, float]:
    """Fastest ms per step of each implementation, stepped in turns: `{impl: ms}`."""
    engines = {impl: _filled_engine(model, "cpu", dtype, batch, impl, quantization, cpu_kernels=cpu_kernels)
               for impl in impls}
    best = dict.fromkeys(engines, float("inf"))
    for _ in range(rounds):
        for impl, engine in engines.items():
            start = time.perf_counter()
            for _ in range(steps_per_round):
                engine.step()
            best[impl] = min(best[impl], 1e3 * (time.perf_counter() - start) / steps_per_round)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=MODEL_DTYPES)
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--modes", default=None,
                        help="eager, graphs (decode steps replayed as CUDA graphs); default: both on CUDA, eager on CPU")
    parser.add_argument("--model-impls", default="auto", help="comma-separated: auto, carpool, transformers")
    parser.add_argument("--quantization", default=None, choices=["int8", "fp8"], help="weights; default: unquantized")
    parser.add_argument("--cpu-kernels", default="auto", choices=["auto", "on", "off"],
                        help="CPU: the compiled decode-attention kernel (the engine's --cpu-kernels); default: auto")
    parser.add_argument("--matmul-tuning", default="auto", choices=["auto", "on", "off"],
                        help="CUDA: time decode-sized matrix products at start-up and keep the fastest (the "
                             "engine's --matmul-tuning); off: torch's matmul; default: auto")
    parser.add_argument("--timed-steps", type=int, default=100)
    parser.add_argument("--tables", action="store_true", help="also print each run's top kernels")
    parser.add_argument("--alternate", type=int, default=None, metavar="ROUNDS",
                        help="CPU: step the implementations in turns for this many rounds; report each one's fastest")
    args = parser.parse_args()
    freeze_imported_heap()
    cpu_kernels = {"auto": None, "on": True, "off": False}[args.cpu_kernels]
    is_cuda = args.device.startswith("cuda")
    if is_cuda and not torch.cuda.is_available():
        sys.exit("bench.step_profile --device cuda needs a CUDA device; none is available here (try --device cpu).")
    modes = [m for m in (args.modes or (",".join(MODES) if is_cuda else "eager")).split(",") if m]
    if unknown := set(modes) - set(MODES):
        sys.exit(f"--modes: unknown {sorted(unknown)}; modes are {', '.join(MODES)}")
    if not is_cuda and modes != ["eager"]:
        sys.exit("--modes: CUDA graphs need --device cuda")
    if not is_cuda:
        torch.set_num_threads(1)
    name = torch.cuda.get_device_name() if is_cuda else "CPU, 1 torch thread"
    weights = f", {args.quantization} weights" if args.quantization else ""
    print(f"device: {name}; model {args.model}, {args.dtype}{weights}\n")
    if args.alternate is not None:
        if is_cuda:
            sys.exit("--alternate: CPU only (on CUDA, kernel time does not drift with the machine's load)")
        impls = args.model_impls.split(",")
        print("| batch | " + " | ".join(f"{impl} ms/step" for impl in impls) + " | " +
              " | ".join(f"{impl} / {impls[-1]}" for impl in impls[:-1]) + " |")
        print("|---" * (2 * len(impls)) + "|")
        for batch in (int(b) for b in args.batches.split(",")):
            best = alternate_cpu(args.model, args.dtype, batch, impls, args.alternate, args.quantization,
                                 cpu_kernels=cpu_kernels)
            ratios = [best[impl] / best[impls[-1]] for impl in impls[:-1]]
            print(f"| {batch} | " + " | ".join(f"{best[impl]:.2f}" for impl in impls) + " | " +
                  " | ".join(f"{r:.2f}" for r in ratios) + " |", flush=True)
        return
    rows = []
    for impl in args.model_impls.split(","):
        for mode in modes:
            for batch in (int(b) for b in args.batches.split(",")):
                result = profile_batch(args.model, args.device, args.dtype, batch, mode, args.timed_steps, impl,
                                       args.quantization, cpu_kernels,
                                       {"auto": None, "on": True, "off": False}[args.matmul_tuning])
                rows.append(result)
                if args.tables and result.top_kernels:
                    print(f"## {impl}, {mode}, batch {batch}\n{result.top_kernels}")
                if is_cuda:
                    torch.cuda.empty_cache()
    print(TABLE_HEADER)
    for r in rows:
        print(table_row(r))


if __name__ == "__main__":
    main()
