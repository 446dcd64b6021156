"""The GPU check's plan and report, which run anywhere: which rows the flags select and in what order, the
report rewritten after every row, failures and the time budget written as rows of their own."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.gpu_check import (
    NEAR_TIE_LOGPROB,
    PARTS,
    Report,
    Row,
    Section,
    first_difference,
    parse_parts,
    plan,
    progress,
)


def test_the_targets_come_first_whatever_order_the_parts_are_named_in() -> None:
    sections = plan("/no/model", "bfloat16", ["lookup", "tests", "steps"], tests_timeout_s=1.0)
    assert [s.part for s in sections] == ["steps", "steps", "steps", "steps", "tests", "lookup"]
    assert [r.name for r in sections[0].rows] == ["memory bandwidth"]
    assert [r.name for r in sections[1].rows][:2] == ["carpool graphs 32", "carpool graphs 128"]
    every = plan("/no/model", "bfloat16", list(PARTS), tests_timeout_s=1.0)
    assert list(dict.fromkeys(s.part for s in every)) == list(PARTS)


def test_unknown_parts_are_refused() -> None:
    assert parse_parts("skewed, steps") == ["skewed", "steps"]
    for text in ("steps,graphs", "", ","):
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated list of steps"):
            parse_parts(text)


def test_the_plan_is_printed_without_a_gpu() -> None:
    result = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--plan", "--parts", "identity,skewed"],
                            capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.splitlines() == [
        "skewed: carpool, graphs; carpool, eager; transformers generate; transformers generate_batch",
        "identity: graph vs eager greedy; reading each step vs scheduling ahead, greedy; reading each step vs "
        "scheduling ahead, seeded draws with a repetition penalty",
    ]


def test_each_row_is_in_the_file_before_the_next_starts_and_a_failure_is_a_row(tmp_path: Path) -> None:
    path = tmp_path / "gpu_check.md"
    seen: list[str] = []

    def second() -> str:
        seen.append(path.read_text())
        raise RuntimeError("the kernel did not compile")

    def third() -> str:
        seen.append(path.read_text())
        return "| c | 3 |"

    report = Report(path, ["device: a test"], budget_s=float("inf"))
    report.run(Section("p", ["| row | value |", "|---|---|"],
                       [Row("a", lambda: "| a | 1 |", 2), Row("b", second, 2), Row("c", third, 2)]))
    report.finish()
    assert seen[0].splitlines()[-1] == "| a | 1 |"
    assert seen[1].splitlines()[-1] == "| b | failed: RuntimeError: the kernel did not compile |"
    lines = path.read_text().splitlines()
    assert lines[:6] == ["device: a test", "", "| row | value |", "|---|---|", "| a | 1 |",
                         "| b | failed: RuntimeError: the kernel did not compile |"]
    assert lines[6] == "| c | 3 |"
    assert lines[-1].startswith("The check took ") and lines[-1].endswith(" s.")


def test_no_row_starts_past_the_budget_and_the_file_names_those_left_out(tmp_path: Path) -> None:
    path = tmp_path / "gpu_check.md"
    called: list[str] = []

    def measure(name: str) -> str:
        called.append(name)
        return f"| {name} | done | |"

    report = Report(path, ["device: a test"], budget_s=0.0)
    report.run(Section("p", ["| row | value | detail |", "|---|---|---|"],
                       [Row("x", lambda: measure("x"), 3), Row("y", lambda: measure("y"), 3)]))
    report.finish()
    assert called == []
    lines = path.read_text().splitlines()
    assert lines[4:6] == ["| x | not run: the check's 0 s had passed |  |", "| y | not run: the check's 0 s had passed |  |"]
    assert lines[-1].endswith("; not run for its time budget: x, y.")


def test_a_parting_of_greedy_outputs_is_told_a_near_tie_or_not(tiny_model: Callable[..., str]) -> None:
    from scheduler.params import SamplingParams
    from worker.engine.engine import Engine

    engine = Engine(model=tiny_model("llama"), num_blocks=32)
    (eager,) = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True))
    assert eager.logprobs is not None
    assert first_difference(eager.token_ids, list(eager.token_ids), eager.logprobs) == "same"
    assert first_difference(eager.token_ids, eager.token_ids[:4], eager.logprobs) == "lengths 6 and 4"
    graphed = list(eager.token_ids)
    graphed[3] = eager.logprobs[3]["top_logprobs"][1]["token_id"]
    top = eager.logprobs[3]["top_logprobs"]
    margin = top[0]["logprob"] - top[1]["logprob"]
    kind = "a near tie" if margin < NEAR_TIE_LOGPROB else "NOT a near tie"
    assert first_difference(eager.token_ids, graphed, eager.logprobs) == (
        f"differs at 3 (top-2 margin {margin:.3f}: {kind})")
    assert first_difference(eager.token_ids, graphed, None) == "differs at 3"


def test_skipped_rows_are_written_as_skipped_without_running() -> None:
    from bench.gpu_check import Row, Section, skipping

    def measured() -> str:
        raise AssertionError("a skipped row ran")

    sections = skipping([Section("skewed", ["| a | b | c |"], [Row("transformers generate", measured, 3),
                                                                  Row("carpool, graphs", lambda: "| ran | | |", 3)])],
                        ["transformers"])
    assert [row.measure() for row in sections[0].rows] == ["| transformers generate | skipped (--skip) |  |",
                                                           "| ran | | |"]


def test_tests_stopped_by_their_time_limit_say_how_far_they_got(tmp_path: Path) -> None:
    """A real pytest run's quiet output, an assertion's diff lines (`E  ...`) among it: only the progress marks
    count."""
    (tmp_path / "test_three.py").write_text(
        "import pytest\n\n"
        "def test_passes():\n    assert True\n\n"
        "def test_fails():\n    assert [1, 2, 3] == [1, 2, 4]\n\n"
        "def test_skipped():\n    pytest.skip('not here')\n"
    )
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                          "-n", "0", str(tmp_path / "test_three.py")], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 1 and "\nE  " in run.stdout
    assert progress(run.stdout) == "1 passed, 1 failed, 1 skipped so far"
    assert progress("ImportError: no module named redis\n") == ""
