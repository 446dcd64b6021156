"""Torch's intra-op thread count: one in the test session, `--torch-threads` at the worker's process edge."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from scheduler.runtime.flags import config_from_args
from tests.harness.child_env import child_pythonpath
from worker.cli import build_parser
from worker.config import WorkerConfig

REPO = Path(__file__).resolve().parents[2]


def test_the_test_session_runs_torch_on_one_thread() -> None:
    assert torch.get_num_threads() == 1


def test_torch_threads_flag_and_environment() -> None:
    args = build_parser({}).parse_args(["worker", "--torch-threads", "3"])
    assert config_from_args(WorkerConfig, args).torch_threads == 3
    args = build_parser({"CARPOOL_TORCH_THREADS": "2"}).parse_args(["worker"])
    assert config_from_args(WorkerConfig, args).torch_threads == 2
    assert WorkerConfig().torch_threads == 0


def test_negative_torch_threads_is_refused() -> None:
    try:
        WorkerConfig(torch_threads=-1)
    except ValueError as e:
        assert "torch_threads" in str(e)
    else:
        raise AssertionError("torch_threads=-1 was accepted")


def threads_after_generate(model: str, *flags: str) -> int:
    """Run `carpool generate` in a fresh interpreter and report torch's thread count afterwards."""
    code = (
        "import sys, torch, worker.cli as cli\n"
        "code = cli.main(sys.argv[1:], env={})\n"
        "print('threads', torch.get_num_threads(), code)\n"
    )
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, "-c", code, "generate", "hello", "--max-tokens", "2", "--model", model, *flags],
        capture_output=True, text=True, env=env, timeout=120, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1].split()
    assert last[0] == "threads" and last[2] == "0", done.stdout
    return int(last[1])


def test_generate_applies_torch_threads_at_start(tiny_model) -> None:
    model = tiny_model()
    assert threads_after_generate(model, "--torch-threads", "2") == 2
    # 0 (the default) on CPU: one thread, which measured fastest for small models on a shared box.
    assert threads_after_generate(model) == 1
