"""The code type-checks: mypy, configured in pyproject.toml, finds no error in the packages."""

from __future__ import annotations

from pathlib import Path

import pytest
from mypy import api

ROOT = Path(__file__).resolve().parent.parent


def test_packages_type_check(monkeypatch: pytest.MonkeyPatch) -> None:
    # The packages named in [tool.mypy] resolve from the repository root, and its .mypy_cache keeps
    # later runs incremental (a cold run reads all of torch's and transformers' types: tens of seconds).
    monkeypatch.chdir(ROOT)
    report, errors, status = api.run(["--config-file", str(ROOT / "pyproject.toml")])
    assert status == 0, f"mypy found errors:\n{report}{errors}"
    assert report.startswith("Success: no issues found"), report
