"""`carpool up` killed outright (SIGKILL) takes its Redis and worker with it, so the next `carpool up` finds its
ports free; a closed terminal's SIGHUP shuts it down in order, like Ctrl-C."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.harness.up_stack import UpStack, start_up


def _is_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead and waiting for its new parent to reap it, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _redis_pid(stack: UpStack) -> int:
    """The bundled redis-server of `stack`, found by its port on its command line."""
    for proc in Path("/proc").iterdir():
        try:
            # redis-server retitles itself: "PATH/redis-server 127.0.0.1:PORT"
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except (FileNotFoundError, PermissionError, NotADirectoryError):
            continue
        if b"redis-server" in cmdline and re.search(rb"[ :]%d\b" % stack.redis_port, cmdline):
            return int(proc.name)
    raise AssertionError(f"no redis-server on port {stack.redis_port}")


def _worker_pid(stack: UpStack) -> int:
    (pid,) = re.findall(r"carpool: worker +pid (\d+)", stack.log())
    return int(pid)


@pytest.mark.slow
def test_a_killed_up_takes_its_redis_and_worker_with_it(tiny_model: Callable[..., str], tmp_path: Path) -> None:
    stack = start_up(tmp_path, "--model", tiny_model("llama"))
    try:
        children = [_redis_pid(stack), _worker_pid(stack)]
        assert all(_is_alive(pid) for pid in children)
        stack.proc.kill()
        stack.proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while any(_is_alive(pid) for pid in children):
            assert time.monotonic() < deadline, [pid for pid in children if _is_alive(pid)]
            time.sleep(0.05)
    finally:
        stack.stop()


@pytest.mark.slow
def test_a_closed_terminal_shuts_up_down_in_order(tiny_model: Callable[..., str], tmp_path: Path) -> None:
    stack = start_up(tmp_path, "--model", tiny_model("llama"))
    try:
        children = [_redis_pid(stack), _worker_pid(stack)]
        stack.proc.send_signal(signal.SIGHUP)
        code = stack.proc.wait(timeout=60)
    finally:
        stack.stop()
    assert code == 0, stack.log()
    log = stack.log()
    assert "carpool: shutting down" in log and "carpool: worker stopped (0)" in log, log
    assert log.rstrip().endswith("carpool: redis stopped"), log
    assert not any(_is_alive(pid) for pid in children)
