"""The layering holds: import-linter's contracts in pyproject.toml (policy imports only the standard
library, the gateway no torch and nothing of the worker, the worker's service no torch, packages depend
downwards, no cycles inside any package) are all kept."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept() -> None:
    # The script beside this interpreter (its virtualenv's bin, activated or not), else the one on PATH.
    beside = Path(sys.executable).parent / "lint-imports"
    lint_imports = str(beside) if beside.is_file() else shutil.which("lint-imports")
    assert lint_imports is not None, "lint-imports (import-linter, a test dependency) is not installed"
    done = subprocess.run([lint_imports, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout, done.stdout
