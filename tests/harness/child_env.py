"""The PYTHONPATH a test's child process gets: the repository first, then whatever the test run itself had."""

from __future__ import annotations

import os
from pathlib import Path


def child_pythonpath(repo: Path) -> str:
    return os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p)
