"""The code type-checks: mypy, configured in pyproject.toml, finds no error in the packages, and
``mypy --strict`` finds none in the scheduling policy and the job protocol."""

from __future__ import annotations

from pathlib import Path

import pytest
from mypy import api

ROOT = Path(__file__).resolve().parents[2]

STRICT = [
    "-m", "scheduler", "-m", "scheduler.block_manager", "-m", "scheduler.params", "-m", "scheduler.scheduler",
    "-m", "scheduler.scheduler_config", "-m", "scheduler.scheduler_output", "-m", "scheduler.sequence",
    "-p", "scheduler.protocol",
]
"""The policy (scheduler's own modules) and the job protocol (scheduler.protocol), checked with --strict."""


def test_packages_type_check(monkeypatch: pytest.MonkeyPatch) -> None:
    # The packages named in [tool.mypy] resolve from the repository root, and its .mypy_cache keeps
    # later runs incremental (a cold run reads all of torch's types: over ten seconds).
    monkeypatch.chdir(ROOT)
    report, errors, status = api.run(["--config-file", str(ROOT / "pyproject.toml")])
    assert status == 0, f"mypy found errors:\n{report}{errors}"
    assert report.startswith("Success: no issues found"), report


def test_policy_and_protocol_type_check_strictly(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its own cache: the strict options would otherwise invalidate the whole-package run's cache entries.
    monkeypatch.chdir(ROOT)
    report, errors, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), "--strict",
                                      "--cache-dir", str(ROOT / ".mypy_cache" / "strict"), *STRICT])
    assert status == 0, f"mypy --strict found errors:\n{report}{errors}"
    assert report.startswith("Success: no issues found"), report
