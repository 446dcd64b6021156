"""A test's child processes: the PYTHONPATH they get (the repository first, then whatever the test run itself had),
and how they are stopped."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def child_pythonpath(repo: Path) -> str:
    return os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 15) -> None:
    """SIGTERM, and SIGKILL if it has not exited within `timeout_s`; reaped either way."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
