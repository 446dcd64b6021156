"""Prompt lookup against plain decoding: the repetitive workload (where it should pay) and `skewed` (where it
should cost next to nothing), each as back-to-back pairs on fresh engines.

`carpool bench` runs these pairs with everything else; on their own, with the same settings:

    python -m bench.speculative [--model PATH] [--pairs 3]
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.config import BenchConfig
from bench.offline import make_engine, run_offline
from bench.records import summarize
from bench.repetitive import make_cycling_model
from bench.workloads import Workload

if TYPE_CHECKING:
    from bench.records import BenchReport

PLAIN = "continuous, speculation off"
PROMPT_LOOKUP = "continuous, prompt lookup"


def repeat_key(workload: Workload) -> str:
    """The key of ``BenchReport.repeats`` that holds the workload's pairs."""
    return f"{workload.name}, prompt lookup"


def run_speculative_pairs(config: BenchConfig, model: str, workloads: list[Workload], report: BenchReport,
                          tick: Callable[[str], Callable[[int], None]]) -> None:
    """Each workload (the repetitive one on a cycling copy of ``model``) with and without prompt lookup.

    The order within a pair alternates, so a machine that slows down over the run favours neither side;
    the first pair's runs go into the report's tables.
    """
    with tempfile.TemporaryDirectory(prefix="carpool-bench-") as tmp:
        cycling = str(make_cycling_model(model, Path(tmp) / "cycling"))
        for workload in workloads:
            path = cycling if workload.name == "repetitive" else model
            pairs: list[dict[str, float | None]] = []
            for k in range(config.speculative_pairs):
                order = [(PLAIN, None), (PROMPT_LOOKUP, "ngram")]
                pair: dict[str, float | None] = {}
                for system, speculative in order if k % 2 == 0 else order[::-1]:
                    engine = make_engine(path, "continuous", config.max_num_seqs, max_wait_ms=config.max_wait_ms,
                                         device=config.device, dtype=config.dtype, speculative=speculative)
                    run = run_offline(engine, workload, system, tick(f"{workload.name} {system}"))
                    run.extra.update(_spec_stats(engine))
                    pair[system] = summarize(run)["output_tokens_per_s"]
                    if k == 0:
                        report.runs.append(run)
                    del engine
                    gc.collect()
                pairs.append(pair)
            report.repeats[repeat_key(workload)] = pairs


def _spec_stats(engine: Any) -> dict[str, Any]:
    stats = engine.stats()
    drafts = stats.spec_num_drafts
    return {"spec_proposed_tokens": stats.spec_proposed_tokens, "spec_accepted_tokens": stats.spec_accepted_tokens,
            "spec_mean_accepted_length": round(1 + stats.spec_accepted_tokens / drafts, 3) if drafts else None}


def interleaved(model: str, workload: Workload, config: BenchConfig, steps_per_round: int = 10) -> dict[str, float]:
    """Output tokens/s of both systems on ``workload``, their engines stepped in alternating rounds in one
    process: a machine whose speed drifts (a shared one) slows both sides alike."""
    from scheduler.params import SamplingParams

    engines = {system: make_engine(model, "continuous", config.max_num_seqs, max_wait_ms=config.max_wait_ms,
                                   device=config.device, dtype=config.dtype, speculative=speculative)
               for system, speculative in ((PLAIN, None), (PROMPT_LOOKUP, "ngram"))}
    busy_s = dict.fromkeys(engines, 0.0)
    tokens = dict.fromkeys(engines, 0)
    for engine in engines.values():
        for i, r in enumerate(workload.requests):
            engine.add_request(str(i), r.prompt_token_ids, SamplingParams(
                max_tokens=r.max_tokens, ignore_eos=True, temperature=r.temperature))
    while any(e.has_unfinished_requests() for e in engines.values()):
        for system, engine in engines.items():
            for _ in range(steps_per_round):
                if not engine.has_unfinished_requests():
                    break
                start = time.perf_counter()
                outputs = engine.step()
                busy_s[system] += time.perf_counter() - start
                tokens[system] += sum(len(o.new_token_ids) for o in outputs)
    return {system: tokens[system] / busy_s[system] for system in engines}


def main() -> None:
    import argparse

    import torch

    from bench.plan import build_workloads, describe_machine
    from bench.records import BenchReport
    from worker.engine.default_model import default_model_path, models_cache_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory; default: the built-in model")
    parser.add_argument("--pairs", type=int, default=BenchConfig().speculative_pairs)
    parser.add_argument("--interleaved", action="store_true",
                        help="instead: both engines stepped in alternating rounds in one process, on each workload")
    args = parser.parse_args()
    config = BenchConfig(speculative_pairs=args.pairs)
    torch.set_num_threads(config.threads)
    model = args.model or str(default_model_path(models_cache_dir(os.environ)))
    w = build_workloads(config)
    if args.interleaved:
        print(describe_machine())
        print("| workload | off tok/s | prompt lookup tok/s | ratio |\n|---|---|---|---|")
        with tempfile.TemporaryDirectory(prefix="carpool-bench-") as tmp:
            cycling = str(make_cycling_model(model, Path(tmp) / "cycling"))
            for workload, path in ((w.repetitive, cycling), (w.skewed, model)):
                for _ in range(args.pairs):
                    rates = interleaved(path, workload, config)
                    print(f"| {workload.name} | {rates[PLAIN]:,.0f} | {rates[PROMPT_LOOKUP]:,.0f} | "
                          f"{rates[PROMPT_LOOKUP] / rates[PLAIN]:.3f} |", flush=True)
        return
    report = BenchReport(config={}, machine=describe_machine())
    run_speculative_pairs(config, model, [w.repetitive, w.skewed], report, lambda phase: lambda n: None)
    print(report.machine)
    print("| workload | pair | off tok/s | prompt lookup tok/s | ratio |\n|---|---|---|---|---|")
    for workload in (w.repetitive, w.skewed):
        for i, pair in enumerate(report.repeats[repeat_key(workload)]):
            off, on = pair[PLAIN] or 0.0, pair[PROMPT_LOOKUP] or 0.0
            print(f"| {workload.name} | {i + 1} | {off:,.0f} | {on:,.0f} | {on / off:.3f} |")
    for run in report.runs:
        print(run.workload, run.system, {k: v for k, v in run.extra.items() if k.startswith("spec")})


if __name__ == "__main__":
    main()
