"""The GPU check: one command that builds, checks and times the engine on a CUDA GPU.

    python -m bench.gpu_check [--model /tmp/m1b] [--output gpu-check] [--parts steps,skewed,...]
                              [--budget-s 480] [--plan]

Its parts, in the order they run (`--parts` picks some, in this order whatever order it names them):

- `steps`: the GPU memory's bandwidth (a device-to-device copy), then `bench.step_profile`'s decode step for
  carpool's own model, graphed at batch 32 and 128 first (the targets), then graphed at 32 and 8 with torch's
  matmul only (`torch-matmul`: the engine's timed matmul choice off, its baseline), then graphed at 1 and 8,
  then eager,
  and the transformers path at batch 32, graphed and eager: wall time, GPU kernel time, and the rate the
  matrix products read the model's matrices at as a share of that bandwidth; then the host's share of a
  graphed step at batch 32 and 128, part by part (`bench.host_phases`), and the sampler alone at those
  batches, its race kernel against torch ops (`bench.sampler_speed`);
- `matmul`: each of the 1B model's matrix kinds (qkv, o, gate_up, down over 22 distinct copies, lm_head) at 1,
  8 and 32 rows, bf16 and int8, as a step reads them (`bench.decode_matmul`): torch's product against the
  matmul kernel's default launch and its fastest candidate, each as a share of the copy bandwidth;
- `skewed`: continuous batching on `skewed` at 32 slots (`bench.skewed_gpu`), graphed and eager, beside
  transformers' padded `generate` and `generate_batch` on the same requests and slots;
- `identity`: greedy tokens of decode steps replayed as CUDA graphs against eager ones, one batch of
  prompts of 100 to ~8k tokens, 200 new tokens each; then the engine reading each step's tokens before
  scheduling the next against scheduling ahead, greedy and with seeded draws under a repetition penalty;
- `tests`: the kernel and engine tests, compiled for the GPU (`pytest` on the Triton kernel files, the
  sampler with its race kernel, the graph runner and the own models' and Triton engine's greedy exactness); they need the test
  dependencies (`pip install -e '.[test]'`: the suite's `conftest.py` imports redis, for one), and say
  which is missing where one is;
- `quantized`: the graphed decode step at batch 8 and 32 with `int8` and `fp8` weights against the
  model's dtype (target on an H100: at most 0.6x of bf16's step);
- `lookup`: prompt lookup on the repetitive workload (a cycling copy of the model) and on `skewed`, 32
  slots, with `--speculative ngram` against without (target on an H100: at least 2x output tok/s); with
  it, steps that verify proposals replay verify graphs, and the table counts the steps each run replayed.

The targets come first so that a short lease measures them. No row starts once `--budget-s` seconds
have passed since the check began; each row left out is written as not run, so the tables say what is
missing. OUTPUT/gpu_check.md is rewritten after every row, so whatever ended the run, the rows done are
there. `--plan` prints the rows the other flags select, without a GPU; `--skip` writes the rows whose names
hold the given texts as skipped (the baselines of an earlier run, say). The 1B model
(`bench.gpu.make_1b_model`) is built first if `--model` does not exist.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import random
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

KERNEL_TESTS = ["tests/kernels/test_kernels.py", "tests/kernels/test_kernels_paged_decode.py",
                "tests/kernels/test_kernels_torch.py", "tests/kernels/test_kernels_model.py",
                "tests/kernels/test_decode_matmul.py", "tests/kernels/test_sample_race.py",
                "tests/worker/engine/test_sampler.py",
                "tests/worker/engine/test_engine_triton.py", "tests/worker/engine/test_graph_runner.py",
                "tests/worker/engine/test_own_models.py",
                "tests/worker/engine/test_speculative.py::test_greedy_ngram_through_the_triton_kernels"]
PARTS = ("steps", "matmul", "skewed", "identity", "tests", "quantized", "lookup")
# (implementation, mode, batch, matmul tuning): the engine's default (None) but for the baseline of the timed
# matmul choice, torch's matmul only (False), at the batches the choice covers.
STEP_RUNS = [("carpool", "graphs", 32, None), ("carpool", "graphs", 128, None), ("carpool", "graphs", 32, False),
             ("carpool", "graphs", 1, None), ("carpool", "graphs", 8, None), ("carpool", "graphs", 8, False),
             ("carpool", "eager", 32, None), ("carpool", "eager", 128, None), ("carpool", "eager", 1, None),
             ("carpool", "eager", 8, None), ("transformers", "graphs", 32, None), ("transformers", "eager", 32, None)]
SKEWED_SLOTS = 32
SKEWED_REQUESTS = 64
QUANTIZED_BATCHES = (8, 32)
REPETITIVE_REQUESTS = 64
REPETITIVE_NEW_TOKENS = 256
HOST_PHASE_BATCHES = [32, 128]
SAMPLER_STEPS = 50
IDENTITY_PROMPT_LENS = [100, 400, 1000, 2000, 3000, 4500, 6000, 7900]
IDENTITY_NEW_TOKENS = 200
COPY_BYTES = 2 << 30


@dataclass(frozen=True)
class Row:
    """One line of a table: `measure` returns it; `name` and `width` (its columns) make the line that says it
    failed or did not run."""

    name: str
    measure: Callable[[], str]
    width: int


@dataclass(frozen=True)
class Section:
    part: str
    header: list[str]
    rows: list[Row]


class Report:
    """The check's markdown, rewritten to `path` after every row, and its time budget: no row starts once
    `budget_s` seconds have passed since the report was made."""

    def __init__(self, path: Path, title: list[str], budget_s: float, row_limit_s: float | None = None,
                 started: float | None = None) -> None:
        self.path = path
        self.lines = list(title)
        self.budget_s = budget_s
        self.row_limit_s = row_limit_s
        self.started = time.monotonic() if started is None else started
        """`time.monotonic()` when the check began: the budget counts from then."""
        self.not_run: list[str] = []
        self._write()

    def add(self, lines: list[str]) -> None:
        self.lines += lines
        self._write()

    def run(self, section: Section) -> None:
        self.add(["", *section.header])
        for row in section.rows:
            row_start = time.monotonic()
            if row_start - self.started >= self.budget_s:
                self.not_run.append(row.name)
                line = _note_row(row, f"not run: the check's {self.budget_s:.0f} s had passed")
            else:
                # A row that hangs (a kernel that never ends, say) ends the process with every thread's stack;
                # the rows before it are in the file already.
                if self.row_limit_s is not None:
                    faulthandler.dump_traceback_later(self.row_limit_s, exit=True)
                try:
                    line = guarded(row)
                finally:
                    faulthandler.cancel_dump_traceback_later()
                now = time.monotonic()
                print(f"[{row.name}: {now - row_start:.0f} s; {now - self.started:.0f} s into the check]", flush=True)
            print(line, flush=True)
            self.add([line])

    def finish(self) -> None:
        took = f"The check took {time.monotonic() - self.started:.0f} s"
        left = f"; not run for its time budget: {', '.join(self.not_run)}." if self.not_run else "."
        self.add(["", took + left])

    def _write(self) -> None:
        self.path.write_text("\n".join(self.lines) + "\n")


def _note_row(row: Row, note: str) -> str:
    return "| " + " | ".join([row.name, note] + [""] * (row.width - 2)) + " |"


def guarded(row: Row) -> str:
    """The row's line, or a line naming its error: a failing row never stops the rows after it."""
    try:
        return row.measure()
    except Exception as exc:  # the check reports every failure and goes on
        traceback.print_exc()
        return _note_row(row, f"failed: {type(exc).__name__}: {str(exc)[:200]}")


def run_tests(timeout_s: float) -> str:
    """Every test runs, past a failure (a lease seldom has time for a second try), and the failures are named."""
    started = time.perf_counter()
    try:
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-n", "0",
                                 *KERNEL_TESTS], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout.decode(errors="replace") if isinstance(expired.stdout, bytes) else expired.stdout
        print(output[-6000:] if output else "")
        return f"| compiled kernel and engine tests | stopped after {timeout_s:.0f} s | {progress(output or '')} |"
    # pytest's summary line; when pytest could not even start (a test dependency missing), its error's last line.
    last = (result.stdout.strip().splitlines() or result.stderr.strip().splitlines() or ["(no output)"])[-1]
    if result.returncode != 0:
        print(result.stdout[-6000:], result.stderr[-3000:])
    return f"| compiled kernel and engine tests | {last} | {time.perf_counter() - started:.0f} s |"


_PROGRESS_LINE = re.compile(r"^[.FEsxX]+(\s+\[\s*\d+%\])?$")


def progress(output: str) -> str:
    """What pytest's quiet progress lines say so far: the tests passed, failed and skipped before it was stopped."""
    marks = "".join(line.split("[")[0].strip() for line in output.splitlines() if _PROGRESS_LINE.match(line))
    counts = {"passed": marks.count("."), "failed": marks.count("F") + marks.count("E"), "skipped": marks.count("s")}
    return ", ".join(f"{count} {name}" for name, count in counts.items() if count) + " so far" if marks else ""


NEAR_TIE_LOGPROB = 0.05
"""A greedy token whose two most likely candidates were this close (in log-probability) in the eager run may turn
on the last bits of the logits: a graph replays a step at a padded batch size, for which the matrix library may
choose another kernel, and the model's random weights leave many such near ties."""


def first_difference(eager: list[int], graphed: list[int], eager_logprobs: list[dict[str, Any]] | None) -> str:
    """Where two greedy outputs part, and the eager run's top-2 margin there (a near tie, or a real difference)."""
    at = next((i for i, (x, y) in enumerate(zip(eager, graphed)) if x != y), None)
    if at is None:
        return "same" if len(eager) == len(graphed) else f"lengths {len(eager)} and {len(graphed)}"
    top = eager_logprobs[at]["top_logprobs"] if eager_logprobs is not None else []
    if len(top) < 2:
        return f"differs at {at}"
    margin = top[0]["logprob"] - top[1]["logprob"]
    kind = "a near tie" if margin < NEAR_TIE_LOGPROB else "NOT a near tie"
    return f"differs at {at} (top-2 margin {margin:.3f}: {kind})"


def _identity_completions(model: str, dtype: str, sampled: bool, settings: list[dict[str, Any]]) -> list[Any]:
    """The identity prompts' completions by one engine per entry of `settings`, one after the other; greedy, or
    seeded draws with a repetition penalty."""
    import torch

    from scheduler.params import SamplingParams
    from worker.engine.engine import Engine

    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in IDENTITY_PROMPT_LENS]
    if sampled:
        params: SamplingParams | list[SamplingParams] = [
            SamplingParams(max_tokens=IDENTITY_NEW_TOKENS, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True,
                           repetition_penalty=1.2, logprobs=2) for i in range(len(prompts))]
    else:
        params = SamplingParams(max_tokens=IDENTITY_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = []
    for setting in settings:
        engine = Engine(model=model, device="cuda", dtype=dtype, max_num_seqs=len(prompts), max_model_len=8192,
                        **setting)
        assert engine.runner.graph_sizes or not setting.get("cuda_graphs"), "graphs were asked for but not recorded"
        runs.append((engine.generate(prompts, params), engine.runner.num_replayed_steps))
        del engine
        gc.collect()
        torch.cuda.empty_cache()  # the next engine sizes its cache from what this one leaves free
    return runs


def engines_identity(model: str, dtype: str, label: str, settings: list[dict[str, Any]], sampled: bool = False) -> str:
    """Whether two engine settings give the same tokens on the identity prompts; where a greedy pair parts, the
    first run's top-2 margin there says whether that was a near tie."""
    (first, _), (second, replayed) = _identity_completions(model, dtype, sampled, settings)
    details = [first_difference(a.token_ids, b.token_ids, None if sampled else a.logprobs)
               for a, b in zip(first, second)]
    same = details.count("same")
    real = sum("NOT a near tie" in d for d in details)
    detail = ", ".join(f"{n}: {d}" for n, d in zip(IDENTITY_PROMPT_LENS, details))
    parted = "" if sampled else f", {real} parted other than at a near tie"
    return (f"| {label}, {len(first)} prompts × {IDENTITY_NEW_TOKENS} tokens | {same}/{len(first)} identical"
            f"{parted} ({replayed} replayed steps) | {detail} |")


IDENTITY_ROWS: list[tuple[str, list[dict[str, Any]], bool]] = [
    ("graph vs eager greedy", [{"cuda_graphs": False}, {"cuda_graphs": True}], False),
    ("reading each step vs scheduling ahead, greedy",
     [{"cuda_graphs": True, "async_scheduling": False}, {"cuda_graphs": True, "async_scheduling": True}], False),
    ("reading each step vs scheduling ahead, seeded draws with a repetition penalty",
     [{"cuda_graphs": True, "async_scheduling": False}, {"cuda_graphs": True, "async_scheduling": True}], True),
]
"""Each: the row's name, the two engines' settings, whether the requests draw (else greedy). Scheduling ahead
changes no batch here (every prompt runs to the same length), so its rows must be identical."""


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


def _freeing(measure: Callable[[], str]) -> Callable[[], str]:
    """`measure`, then its garbage collected and the CUDA cache emptied: each engine sizes its KV cache from the
    memory left free, so nothing of the row before may hold on to any."""

    def run() -> str:
        import torch

        try:
            return measure()
        finally:
            gc.collect()
            torch.cuda.empty_cache()

    return run


def step_sections(model: str, dtype: str) -> list[Section]:
    from bench.step_profile import TABLE_HEADER, profile_batch, table_row

    bandwidth: dict[str, float] = {}

    def copy_row() -> str:
        bandwidth["gbps"] = copy_bandwidth_gbps()
        return (f"| memory bandwidth | {bandwidth['gbps']:,.0f} GB/s | a device-to-device copy of {COPY_BYTES >> 30} GiB, "
                "read and write counted; `weights read at` below is the model's matrices' bytes over the matrix-"
                "product kernels' time, and its share of this |")

    def profile_row(impl: str, mode: str, batch: int, matmul_tuning: bool | None) -> str:
        r = profile_batch(model, "cuda", dtype, batch, mode, model_impl=impl, matmul_tuning=matmul_tuning)
        print(r.top_kernels, flush=True)
        return table_row(r, bandwidth.get("gbps"))

    def phases_row(batch: int) -> str:
        from bench.host_phases import host_phases
        from bench.host_phases import table_row as phases_table_row

        return phases_table_row(host_phases(model, "cuda", dtype, batch))

    def sampler_row(batch: int, race_kernel: bool) -> str:
        import json
        import statistics

        import torch

        from bench.sampler_speed import WORKLOADS, time_workload

        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        times, cpu_times = time_workload(torch.device("cuda"), batch, vocab, WORKLOADS["unseeded T=1"],
                                         SAMPLER_STEPS, race_kernel=race_kernel)
        return (f"| {'race kernel' if race_kernel else 'torch ops'} | {batch} | {vocab} | "
                f"{statistics.median(times) * 1e3:.3f} | {statistics.median(cpu_times) * 1e3:.3f} |")

    from bench.host_phases import PHASES
    from bench.host_phases import TABLE_HEADER as PHASES_HEADER

    return [Section("steps", ["| measure | result | detail |", "|---|---|---|"],
                    [Row("memory bandwidth", _freeing(copy_row), 3)]),
            Section("steps", TABLE_HEADER.splitlines(),
                    [Row(f"{impl} {mode} {batch}{' torch-matmul' if tuning is False else ''}",
                         _freeing(partial(profile_row, impl, mode, batch, tuning)), 10)
                     for impl, mode, batch, tuning in STEP_RUNS]),
            Section("steps", ["host's share of a graphed step (`bench.host_phases`)", "", *PHASES_HEADER.splitlines()],
                    [Row(f"host phases {batch}", _freeing(partial(phases_row, batch)), len(PHASES) + 2)
                     for batch in HOST_PHASE_BATCHES]),
            Section("steps", ["the sampler alone, unseeded T=1 (`bench.sampler_speed`), each step read back",
                              "", "| draw | batch | vocab | step ms | host CPU ms |", "|---|---|---|---|---|"],
                    [Row(f"sampler {'race' if race else 'torch'} {batch}", partial(sampler_row, batch, race), 5)
                     for batch in HOST_PHASE_BATCHES for race in (True, False)])]


MATMUL_ROWS = [1, 8, 32]
MATMUL_WEIGHTS = ("bf16", "int8")


def matmul_section(dtype: str) -> Section:
    """Torch's product against the matmul kernel's launches per matrix kind of the 1B model (`bench.decode_matmul`)."""

    bandwidth: dict[str, float] = {}

    def row(layer: str, weights: str) -> str:
        import torch

        from bench.decode_matmul import LAYERS, kernel_rows

        if "gbps" not in bandwidth:
            bandwidth["gbps"] = copy_bandwidth_gbps()
        _, n, k, copies = next(entry for entry in LAYERS if entry[0] == layer)
        gen = torch.Generator(device="cuda").manual_seed(0)
        activations = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype, torch.bfloat16)
        held = weights if weights != "bf16" else str(activations).removeprefix("torch.")
        return "\n".join(kernel_rows(layer, n, k, copies, held, activations, MATMUL_ROWS, gen, bandwidth["gbps"]))

    from bench.decode_matmul import LAYERS, TABLE_HEADER

    return Section("matmul", ["products timed as a step reads them (`bench.decode_matmul`), GB/s and their share of "
                              "a device-to-device copy's", "", *TABLE_HEADER.splitlines()],
                   [Row(f"matmul {layer} {weights}", _freeing(partial(row, layer, weights)), 8)
                    for layer, *_ in LAYERS for weights in MATMUL_WEIGHTS
                    if layer != "lm_head" or weights == "bf16"])  # lm_head is never quantized


def skewed_section(model: str, dtype: str) -> Section:
    from bench.skewed_gpu import peer_tokens_per_s, skewed_tokens_per_s

    systems: list[tuple[str, Callable[[], tuple[float, int]]]] = [
        (f"carpool, {mode}", partial(skewed_tokens_per_s, model, SKEWED_SLOTS, SKEWED_REQUESTS, "cuda", dtype,
                                     cuda_graphs=mode == "graphs"))
        for mode in ("graphs", "eager")
    ]
    systems += [(f"transformers {peer}", partial(peer_tokens_per_s, peer, model, SKEWED_SLOTS, SKEWED_REQUESTS, "cuda",
                                                 dtype)) for peer in ("generate", "generate_batch")]

    def skewed_row(name: str, measure: Callable[[], tuple[float, int]]) -> str:
        rate, num_tokens = measure()
        return f"| {name} | {num_tokens} | {rate:,.0f} |"

    return Section("skewed", [f"| skewed, {SKEWED_SLOTS} slots, {SKEWED_REQUESTS} requests | output tokens | output tok/s |",
                              "|---|---|---|"],
                   [Row(name, _freeing(partial(skewed_row, name, measure)), 3) for name, measure in systems])


def quantized_section(model: str, dtype: str) -> Section:
    """The graphed decode step with int8 and fp8 weights against the model's dtype, at each batch."""
    from bench.step_profile import profile_batch

    base_ms: dict[int, float] = {}

    def row(weights: str | None, batch: int) -> str:
        r = profile_batch(model, "cuda", dtype, batch, "graphs", quantization=weights)
        if weights is None:
            base_ms[batch] = r.step_ms
        ratio = f"{r.step_ms / base_ms[batch]:.2f}x" if batch in base_ms else "–"
        return f"| {weights or dtype} | {batch} | {r.step_ms:.2f} | {r.kernel_ms:.2f} | {ratio} |"

    return Section("quantized", [f"| weights | batch | step wall ms | GPU kernel ms | vs {dtype} |", "|---|---|---|---|---|"],
                   [Row(f"{weights or dtype} {batch}", _freeing(partial(row, weights, batch)), 5)
                    for batch in QUANTIZED_BATCHES for weights in (None, "int8", "fp8")])


def lookup_section(model: str, dtype: str) -> Section:
    """Output tok/s with and without prompt lookup on the repetitive workload (a cycling copy of the model, made
    beside it as MODEL-cycling) and on `skewed`, 32 slots, engine direct."""
    from bench.offline import make_engine, run_offline
    from bench.repetitive import make_cycling_model, repetitive
    from bench.workloads import skewed

    def cycling_path() -> str:
        path = Path(f"{model.rstrip('/')}-cycling")
        if not (path / "config.json").exists():
            make_cycling_model(model, path)
        return str(path)

    rates: dict[tuple[str, str | None], float] = {}

    def row(name: str, workload: object, path_of: Callable[[], str], speculative: str | None) -> str:
        engine = make_engine(path_of(), "continuous", SKEWED_SLOTS, device="cuda", dtype=dtype, speculative=speculative)
        runner = engine.runner
        assert runner.graph_sizes and (runner.verify_graph_sizes or not speculative), "graphs were not recorded"
        steps_before = engine.stats().num_steps
        replayed_before = (runner.num_replayed_steps, runner.num_replayed_verify_steps)
        run = run_offline(engine, workload, f"continuous, {speculative or 'off'}")  # type: ignore[arg-type]
        tokens = sum(t.num_output_tokens for t in run.requests)
        rates[name, speculative] = tokens / run.duration_s
        stats = engine.stats()
        replayed = runner.num_replayed_steps - replayed_before[0]
        verify = runner.num_replayed_verify_steps - replayed_before[1]
        ratio = f"{rates[name, speculative] / rates[name, None]:.2f}x" if speculative and (name, None) in rates else "–"
        return (f"| {name} | {speculative or 'off'} | {tokens} | {rates[name, speculative]:,.0f} | "
                f"{stats.spec_accepted_tokens:,} / {stats.spec_proposed_tokens:,} | "
                f"{replayed:,} of {stats.num_steps - steps_before:,} ({verify:,} verify) | {ratio} |")

    workloads = [("repetitive", repetitive(REPETITIVE_REQUESTS, max_tokens=REPETITIVE_NEW_TOKENS), cycling_path),
                 ("skewed", skewed(SKEWED_REQUESTS, seed=0), lambda: model)]
    return Section("lookup", [f"| workload, {SKEWED_SLOTS} slots | speculation | output tokens | output tok/s "
                              "| accepted / proposed | steps replayed | ratio |", "|---|---|---|---|---|---|---|"],
                   [Row(f"{name} {speculative or 'off'}", _freeing(partial(row, name, workload, path_of, speculative)), 7)
                    for name, workload, path_of in workloads for speculative in (None, "ngram")])


def plan(model: str, dtype: str, parts: list[str], tests_timeout_s: float) -> list[Section]:
    """The sections of the chosen parts, in the order of `PARTS`."""
    sections: list[Section] = []
    for part in PARTS:
        if part not in parts:
            continue
        if part == "steps":
            sections += step_sections(model, dtype)
        elif part == "matmul":
            sections.append(matmul_section(dtype))
        elif part == "skewed":
            sections.append(skewed_section(model, dtype))
        elif part == "identity":
            sections.append(Section("identity", ["| check | result | detail |", "|---|---|---|"],
                                    [Row(label, _freeing(partial(engines_identity, model, dtype, label, settings, sampled)),
                                         3) for label, settings, sampled in IDENTITY_ROWS]))
        elif part == "tests":
            sections.append(Section("tests", ["| check | result | detail |", "|---|---|---|"],
                                    [Row("compiled kernel and engine tests", partial(run_tests, tests_timeout_s), 3)]))
        elif part == "quantized":
            sections.append(quantized_section(model, dtype))
        else:
            sections.append(lookup_section(model, dtype))
    return sections


def skipping(sections: list[Section], names: list[str]) -> list[Section]:
    """The sections with every row whose name holds one of `names` written as skipped instead of run."""
    def skipped(row: Row) -> Row:
        if not any(name in row.name for name in names):
            return row
        return Row(row.name, partial(_note_row, row, "skipped (--skip)"), row.width)

    return [Section(s.part, s.header, [skipped(row) for row in s.rows]) for s in sections]


def parse_parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"parts: a comma-separated list of {', '.join(PARTS)}; not {text!r}")
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="/tmp/m1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--output", default="gpu-check")
    parser.add_argument("--parts", type=parse_parts, default=list(PARTS),
                        help=f"comma-separated, of {','.join(PARTS)} (default: all)")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="seconds after which no row starts (default: no limit)")
    parser.add_argument("--row-limit-s", type=float, default=600.0,
                        help="a row running longer ends the check, with every thread's stack printed")
    parser.add_argument("--tests-timeout", type=float, default=300.0, help="seconds before the tests are stopped")
    parser.add_argument("--skip", default="",
                        help="comma-separated: rows whose name holds one of these are written as skipped (e.g. "
                             "'transformers' leaves out the baselines already measured)")
    parser.add_argument("--plan", action="store_true", help="print the rows the flags select, and stop")
    args = parser.parse_args()
    started = time.monotonic()
    output = Path(args.output)
    skip = [name.strip() for name in args.skip.split(",") if name.strip()]
    sections = skipping(plan(args.model, args.dtype, args.parts, args.tests_timeout), skip)
    if args.plan:
        for section in sections:
            print(f"{section.part}: " + "; ".join(
                row.name + (" (skipped)" if any(name in row.name for name in skip) else "") for row in section.rows))
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench.gpu_check needs a CUDA GPU; none is available here (--plan lists its rows without one).")
    from bench.step_profile import freeze_imported_heap

    freeze_imported_heap()
    if not (Path(args.model) / "config.json").exists():
        from bench.gpu.make_1b_model import main as make_model

        make_model([args.model])
    output.mkdir(parents=True, exist_ok=True)
    report = Report(output / "gpu_check.md",
                    [f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; model {args.model}, {args.dtype}"],
                    args.budget_s, args.row_limit_s, started)
    for section in sections:
        report.run(section)
    report.finish()
    print("\n".join(report.lines))


if __name__ == "__main__":
    main()
