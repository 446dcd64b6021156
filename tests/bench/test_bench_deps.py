"""`carpool bench` without its optional dependencies stops before any work and names the extra to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.harness.up_stack import REPO, carpool_env


def env_without(module: str, tmp_path: Path) -> dict[str, str]:
    """carpool's environment with `module` gone: a package of that name earlier on the path that cannot be
    imported stands in for one never installed."""
    shadow = tmp_path / "shadow" / module
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(f"raise ModuleNotFoundError(\"No module named '{module}'\")\n")
    env = carpool_env()
    env["PYTHONPATH"] = f"{tmp_path / 'shadow'}:{env['PYTHONPATH']}"
    return env


def test_bench_without_matplotlib_names_the_extra_before_working(tmp_path: Path) -> None:
    env = env_without("matplotlib", tmp_path)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "bench", "--quick", "--output", str(out)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "matplotlib" in done.stderr and "pip install -e '.[bench]'" in done.stderr
    assert not out.exists()  # no work was started


def test_bench_batch_api_without_openai_names_the_extra(tmp_path: Path) -> None:
    """The Batch API workload drives the gateway with the `openai` client, part of the bench extra too."""
    env = env_without("openai", tmp_path)
    for args in (["batch-api", "--help"], ["--workload", "batch-api", "--quick", "--output", str(tmp_path / "o")]):
        done = subprocess.run([sys.executable, "-m", "gateway.cli", "bench", *args],
                              env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr[-2000:]
        assert "Traceback" not in done.stderr and "openai" in done.stderr and "'.[bench]'" in done.stderr, done.stderr
