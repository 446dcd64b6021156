"""Ctrl-C on `carpool up` with a job running: it says what it waits for, and a second Ctrl-C hands
the job back at once instead of waiting out the grace period."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from tests.harness.up_stack import start_up

GRACE_S = 600  # far longer than the test waits: only a hand-back can end the shutdown in time


@pytest.mark.slow
def test_a_second_ctrl_c_hands_running_jobs_back_at_once(
    redis_url: str, tiny_model: Callable[..., str], tmp_path: Path
) -> None:
    stack = start_up(tmp_path, "--redis-url", redis_url, "--model", tiny_model("llama"), "--worker-grace-s", str(GRACE_S))
    client = redis.Redis.from_url(redis_url)
    try:
        body = {"id": "long-one", "prompt": "go on", "params": {"max_tokens": 1900, "ignore_eos": True}}
        req = urllib.request.Request(f"{stack.base}/v1/jobs", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 202
        deadline = time.monotonic() + 60
        while not client.hget("carpool:job:long-one", "checkpoint"):
            assert time.monotonic() < deadline, stack.log()
            time.sleep(0.05)
        stack.proc.send_signal(signal.SIGINT)
        stack.wait_for("running job(s) to finish; Ctrl-C again hands them back now", timeout_s=60)
        assert "the worker's 1 running job(s)" in stack.log()
        stack.proc.send_signal(signal.SIGINT)
        code = stack.proc.wait(timeout=120)
        record = client.hgetall("carpool:job:long-one")
    finally:
        stack.stop()
        client.close()
    assert code == 0, stack.log()
    assert "carpool: handing the running jobs back now" in stack.log()
    assert record[b"status"] == b"running" and record[b"handbacks"] == b"1"
    assert record[b"checkpoint"]


@pytest.mark.slow
def test_a_worker_that_does_not_stop_in_time_is_killed_and_up_exits_1(tiny_model: Callable[..., str],
                                                                       tmp_path: Path) -> None:
    """A worker that fails its own shutdown (here: stopped, so it never answers SIGTERM) is killed once the grace
    period and a few seconds more are over, and up's exit status says the shutdown was not clean."""
    import os
    import re

    stack = start_up(tmp_path, "--model", tiny_model("llama"), "--worker-grace-s", "1")
    try:
        (pid,) = re.findall(r"carpool: worker +pid (\d+)", stack.log())
        os.kill(int(pid), signal.SIGSTOP)
        stack.proc.send_signal(signal.SIGINT)
        code = stack.proc.wait(timeout=60)
    finally:
        stack.stop()
    log = stack.log()
    assert code == 1, log
    assert "carpool: the worker did not stop in time; killing it" in log
    assert f"carpool: worker stopped ({-signal.SIGKILL})" in log and log.rstrip().endswith("carpool: redis stopped")
