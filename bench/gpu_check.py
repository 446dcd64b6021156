"""The GPU check: one command that builds, checks and times the engine on a CUDA GPU.

    python -m bench.gpu_check [--model /tmp/m1b] [--output gpu-check] [--quick]

1. the kernel and engine tests, compiled for the GPU (`pytest` on the Triton kernel files, the graph
   runner and the Triton engine's greedy exactness);
2. decode steps replayed as CUDA graphs against eager steps: greedy tokens of one batch of prompts
   of 100 to ~8k tokens, 200 new tokens each, on the 1B model;
3. `bench.step_profile` at batch 1, 8, 32 and 128, eager and graphed, carpool's own model (and the
   transformers path at batch 32, eager and graphed, for comparison), with the matrix products' kernel time
   and the rate they read the model's matrices at, against the memory bandwidth a device copy measures;
4. continuous batching on `skewed` at 32 slots (`bench.skewed_gpu`), eager and graphed, and transformers'
   padded `generate` and `generate_batch` on the same workload and slots;
5. quantized weights: the decode step (graphed) at batch 8 and 32 with `int8` and `fp8` weights against
   the model's dtype (targets on an H100: at most 0.6x of bf16's step);
6. prompt lookup: the repetitive workload (`bench.repetitive`, on a cycling copy of the 1B model) at
   32 slots with `--speculative ngram` against without (target on an H100: at least 2x output tok/s),
   and `skewed` with it against without.

The 1B model (`bench.gpu.make_1b_model`) is built first if `--model` does not exist. Prints one
table per part, and writes them to OUTPUT/gpu_check.md.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

KERNEL_TESTS = ["tests/kernels/test_kernels.py", "tests/kernels/test_kernels_paged_decode.py",
                "tests/kernels/test_kernels_torch.py", "tests/kernels/test_kernels_model.py",
                "tests/worker/engine/test_engine_triton.py", "tests/worker/engine/test_graph_runner.py",
                "tests/worker/engine/test_own_models.py",
                "tests/worker/engine/test_speculative.py::test_greedy_ngram_through_the_triton_kernels"]
QUANTIZED_BATCHES = (8, 32)
REPETITIVE_REQUESTS = 64
REPETITIVE_NEW_TOKENS = 256
IDENTITY_PROMPT_LENS = [100, 400, 1000, 2000, 3000, 4500, 6000, 7900]
IDENTITY_NEW_TOKENS = 200
COPY_BYTES = 2 << 30


def run_tests(timeout_s: float) -> str:
    started = time.perf_counter()
    try:
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS],
                                capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as expired:
        print(expired.stdout[-6000:] if expired.stdout else "")
        return f"| compiled kernel and engine tests | stopped after {timeout_s:.0f} s | |"
    last = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    if result.returncode != 0:
        print(result.stdout[-6000:], result.stderr[-3000:])
    return f"| compiled kernel and engine tests | {last} | {time.perf_counter() - started:.0f} s |"


def graph_identity(model: str, dtype: str) -> str:
    from scheduler.params import SamplingParams
    from worker.engine.engine import Engine

    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in IDENTITY_PROMPT_LENS]
    params = SamplingParams(max_tokens=IDENTITY_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = {}
    for graphs in (False, True):
        engine = Engine(model=model, device="cuda", dtype=dtype, max_num_seqs=len(prompts), cuda_graphs=graphs,
                        max_model_len=8192)
        assert engine.runner.graph_sizes or not graphs, "graphs were asked for but not recorded"
        tokens[graphs] = [c.token_ids for c in engine.generate(prompts, params)]
        replayed = engine.runner.num_replayed_steps
        del engine
    same = sum(a == b for a, b in zip(tokens[False], tokens[True]))
    first_diffs = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                   for a, b in zip(tokens[False], tokens[True])]
    detail = ", ".join(f"{n}: {'same' if d is None else f'differs at {d}'}" for n, d in zip(IDENTITY_PROMPT_LENS, first_diffs))
    return (f"| graph vs eager greedy, {len(prompts)} prompts × {IDENTITY_NEW_TOKENS} tokens | {same}/{len(prompts)} "
            f"identical ({replayed} replayed steps) | {detail} |")


def quantized_steps(model: str, dtype: str) -> list[str]:
    """The graphed decode step with int8 and fp8 weights against the model's dtype, at each batch."""
    import torch

    from bench.step_profile import profile_batch

    lines = ["", f"| weights | batch | step wall ms | GPU kernel ms | vs {dtype} |", "|---|---|---|---|---|"]
    for batch in QUANTIZED_BATCHES:
        base_ms: dict[str, float] = {}
        for weights in (None, "int8", "fp8"):
            def row(weights: str | None = weights, batch: int = batch) -> str:
                r = profile_batch(model, "cuda", dtype, batch, "graphs", quantization=weights)
                name = weights or dtype
                if weights is None:
                    base_ms["step"] = r.step_ms
                ratio = f"{r.step_ms / base_ms['step']:.2f}x" if "step" in base_ms else "–"
                return f"| {name} | {batch} | {r.step_ms:.2f} | {r.kernel_ms:.2f} | {ratio} |"

            lines.append(guarded(row, f"{weights or dtype} {batch}", 5))
            print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    return lines


def prompt_lookup(model: str, dtype: str, output: Path) -> list[str]:
    """Output tok/s with and without prompt lookup on the repetitive workload (a cycling copy of the model)
    and on `skewed`, 32 slots, engine direct."""
    import torch

    from bench.offline import make_engine, run_offline
    from bench.repetitive import make_cycling_model, repetitive
    from bench.workloads import skewed

    lines = ["", "| workload, 32 slots | speculation | output tokens | output tok/s | accepted / proposed | ratio |",
             "|---|---|---|---|---|---|"]

    def cycling_path() -> str:
        path = output / "cycling-model"
        if not (path / "config.json").exists():
            make_cycling_model(model, path)
        return str(path)

    workloads = [("repetitive", repetitive(REPETITIVE_REQUESTS, max_tokens=REPETITIVE_NEW_TOKENS), cycling_path),
                 ("skewed", skewed(64, seed=0), lambda: model)]
    for name, workload, path_of in workloads:
        rates: dict[str | None, float] = {}
        for speculative in (None, "ngram"):
            def row(speculative: str | None = speculative) -> str:
                engine = make_engine(path_of(), "continuous", 32, device="cuda", dtype=dtype, speculative=speculative)
                run = run_offline(engine, workload, f"continuous, {speculative or 'off'}")
                tokens = sum(t.num_output_tokens for t in run.requests)
                rates[speculative] = tokens / run.duration_s
                stats = engine.stats()
                ratio = f"{rates[speculative] / rates[None]:.2f}x" if None in rates and speculative else "–"
                return (f"| {name} | {speculative or 'off'} | {tokens} | {rates[speculative]:,.0f} | "
                        f"{stats.spec_accepted_tokens:,} / {stats.spec_proposed_tokens:,} | {ratio} |")

            lines.append(guarded(row, f"{name} {speculative or 'off'}", 6))
            print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    return lines


def copy_bandwidth_gbps(num_bytes: int = COPY_BYTES, repeats: int = 10) -> float:
    """The GPU memory's measured bandwidth: a device-to-device copy, its bytes read and written over its time."""
    import torch

    source = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        target.copy_(source)
    end.record()
    end.synchronize()
    return 2 * num_bytes * repeats / (start.elapsed_time(end) / 1e3) / 1e9


def guarded(row: Callable[[], str], name: str, width: int) -> str:
    """One part's table row, or a row naming its error: a failing part never stops the parts after it."""
    try:
        return row()
    except Exception as exc:  # the check reports every failure and goes on
        traceback.print_exc()
        return "| " + " | ".join([name, f"failed: {type(exc).__name__}: {str(exc)[:200]}"] + [""] * (width - 2)) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="/tmp/m1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--output", default="gpu-check")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--tests-timeout", type=float, default=300.0, help="seconds before the tests are stopped")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench.gpu_check needs a CUDA GPU; none is available here.")
    from bench.step_profile import freeze_imported_heap

    freeze_imported_heap()
    if not (Path(args.model) / "config.json").exists():
        from bench.gpu.make_1b_model import main as make_model

        sys.argv = ["make_1b_model", args.model]
        make_model()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; model {args.model}, {args.dtype}", "",
             "| check | result | detail |", "|---|---|---|"]
    if not args.skip_tests:
        lines.append(run_tests(args.tests_timeout))
        print(lines[-1], flush=True)
    lines.append(guarded(lambda: graph_identity(args.model, args.dtype), "graph vs eager greedy", 3))
    print(lines[-1], flush=True)

    from bench.skewed_gpu import peer_tokens_per_s, skewed_tokens_per_s
    from bench.step_profile import TABLE_HEADER, profile_batch, table_row

    copy_gbps: float | None = None
    try:
        copy_gbps = copy_bandwidth_gbps()
        bandwidth = f"{copy_gbps:,.0f} GB/s"
    except Exception as exc:  # reported; the rows then give the read rate without its share
        traceback.print_exc()
        bandwidth = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    torch.cuda.empty_cache()  # the copy's buffers: the engines below size their caches from free memory
    lines += ["", f"measured memory bandwidth (a device-to-device copy of {COPY_BYTES >> 30} GiB, read and write "
                  f"counted): {bandwidth}; `weights read at` is the model's matrices' bytes over the "
                  "matrix-product kernels' time, and its share of that bandwidth", "", TABLE_HEADER]
    runs = [(impl, mode, batch) for impl, batches in (("carpool", (1, 8, 32, 128)), ("transformers", (32,)))
            for mode in ("eager", "graphs") for batch in batches]
    for impl, mode, batch in runs:
        def profile_row(impl: str = impl, mode: str = mode, batch: int = batch) -> str:
            r = profile_batch(args.model, "cuda", args.dtype, batch, mode, model_impl=impl)
            print(r.top_kernels, flush=True)
            return table_row(r, copy_gbps)

        lines.append(guarded(profile_row, f"{impl} {mode} {batch}", 10))
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    lines += ["", "| skewed, 32 slots, 64 requests | output tokens | output tok/s |", "|---|---|---|"]
    systems: list[tuple[str, Callable[[], tuple[float, int]]]] = [
        (f"carpool, {mode}", partial(skewed_tokens_per_s, args.model, 32, 64, "cuda", args.dtype,
                                     cuda_graphs=mode == "graphs"))
        for mode in ("eager", "graphs")
    ]
    systems += [(f"transformers {peer}", partial(peer_tokens_per_s, peer, args.model, 32, 64, "cuda", args.dtype))
                for peer in ("generate", "generate_batch")]
    for name, measure in systems:
        def skewed_row(name: str = name, measure: Callable[[], tuple[float, int]] = measure) -> str:
            rate, num_tokens = measure()
            return f"| {name} | {num_tokens} | {rate:,.0f} |"

        lines.append(guarded(skewed_row, name, 3))
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    lines += quantized_steps(args.model, args.dtype)
    lines += prompt_lookup(args.model, args.dtype, Path(args.output))
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
