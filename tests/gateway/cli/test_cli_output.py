"""What `up`, `submit` and `generate` print about the built-in random-weight model and its output."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cli.main import build_parser
from gateway.cli.submit import job_body
from scheduler.runtime.terminal import printable
from tests.harness.up_stack import UpStack, carpool, start_up

NOTICE = "built-in random-weight model"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpStack]:
    up = start_up(tmp_path_factory.mktemp("up"))  # no --model: the built-in model
    yield up
    assert up.stop() == 0, up.log()


def _is_terminal_safe(text: str) -> bool:
    return all(c.isprintable() or c in "\n\t" for c in text)


@pytest.mark.slow
def test_up_and_submit_say_the_builtin_model_serves_and_submit_escapes_its_bytes(stack: UpStack) -> None:
    assert sum(NOTICE in line for line in stack.log().splitlines()) == 1, stack.log()
    done = carpool("submit", "hello", "--wait", "--max-tokens", "48", "--id", "raw-bytes", "--gateway", stack.base)
    assert done.returncode == 0, done.stderr
    assert sum(NOTICE in line for line in done.stderr.splitlines()) == 1, done.stderr
    with urllib.request.urlopen(f"{stack.base}/v1/jobs/raw-bytes") as resp:
        text = json.loads(resp.read())["output"]["text"]
    assert done.stdout == printable(text) + "\n"
    assert _is_terminal_safe(done.stdout)


def test_generate_says_the_builtin_model_serves_and_escapes_its_bytes() -> None:
    done = carpool("generate", "hello", "--max-tokens", "48")
    assert done.returncode == 0, done.stderr
    assert sum(NOTICE in line for line in done.stderr.splitlines()) == 1, done.stderr
    assert _is_terminal_safe(done.stdout)


def test_submit_and_generate_are_both_greedy_by_default() -> None:
    args = build_parser({}).parse_args(["submit", "hello"])
    assert job_body(args, "hello")["params"]["temperature"] == 0.0
    from worker.cli import build_parser as worker_parser

    assert worker_parser({}).parse_args(["generate", "hello"]).temperature == 0.0


def test_printable_escapes_control_characters_only() -> None:
    assert printable("a\x1b[2Jé\n\x00") == "a\\x1b[2Jé\n\\x00"
