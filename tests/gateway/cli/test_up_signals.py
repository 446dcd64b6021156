"""`carpool up` killed outright (SIGKILL) takes its Redis and worker with it, so the next `carpool up` finds its
ports free; a closed terminal's SIGHUP shuts it down in order, like Ctrl-C."""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.cli.embedded_redis import free_port
from tests.harness.up_stack import REPO, UpStack, carpool_env, start_up


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


@pytest.mark.slow
def test_closing_the_terminal_up_runs_in_shuts_it_down_in_order(tiny_model: Callable[..., str],
                                                                 tmp_path: Path) -> None:
    """The real thing, not a SIGHUP sent by hand: up's controlling terminal (a pseudo-terminal here) hangs up, and
    every later write to it fails; up still stops its gateway, worker and Redis in order and exits 0."""
    port, redis_port = free_port(), free_port()
    controller, terminal = os.openpty()

    def in_the_terminal() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "gateway.cli", "up", "--port", str(port), "--redis-port", str(redis_port),
         "--data-dir", str(tmp_path / "data"), "--worker-grace-s", "5", "--model", tiny_model("llama")],
        cwd=REPO, env=carpool_env(), stdin=terminal, stdout=terminal, stderr=terminal, preexec_fn=in_the_terminal)
    os.close(terminal)
    shown = b""
    try:
        deadline = time.monotonic() + 180
        while b"carpool: ready" not in shown:
            assert proc.poll() is None and time.monotonic() < deadline, shown.decode(errors="replace")
            if select.select([controller], [], [], 0.5)[0]:
                shown += os.read(controller, 65536)
        stack = UpStack(proc, tmp_path / "unused.log", tmp_path / "data", port, redis_port)
        children = [_redis_pid(stack), int(re.findall(rb"carpool: worker +pid (\d+)", shown)[0])]
        os.close(controller)  # the terminal window closes
        controller = -1
        code = proc.wait(timeout=60)
    finally:
        if controller >= 0:
            os.close(controller)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0
    assert not any(_is_alive(pid) for pid in children)
