"""Prompt lookup against plain decoding: the repetitive workload (where it should pay) and `skewed` (where it
should cost next to nothing), each as back-to-back pairs on fresh engines."""

from __future__ import annotations

import gc
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.config import BenchConfig
from bench.offline import make_engine, run_offline
from bench.records import summarize
from bench.repetitive import make_cycling_model
from bench.workloads import Workload

if TYPE_CHECKING:
    from bench.suite import BenchReport

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
