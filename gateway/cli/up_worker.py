"""`carpool up`'s worker child: how it is started, when it is ready, and how it is stopped.

Stopping follows the worker's two phases: SIGTERM closes its intake and lets running jobs finish
within the grace period; up says what it waits for meanwhile, and a second Ctrl-C sends SIGINT,
which makes the worker hand every running job back at once (checkpointed, for another worker).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from scheduler.runtime.flags import config_argv
from scheduler.runtime.tasks import cancel_and_reap

if TYPE_CHECKING:
    from worker.config import WorkerConfig

READY_POLL_S = 0.25
STATUS_EVERY_S = 5.0
"""While the worker drains, how often up says how many jobs it still waits for."""
KILL_AFTER_S = 5.0
"""How long past the grace period the worker may take before it is killed."""


class StackError(RuntimeError):
    pass


@dataclass
class WorkerChild:
    """What `carpool up` hands its worker: the settings up took for it, and the log level."""

    worker: WorkerConfig
    """The worker's settings; only ``flags`` of them are handed on (those up took as flags of its own)."""
    flags: tuple[str, ...]
    log_level: str

    def argv(self, redis_url: str, key_prefix: str, metrics_port: int, grace_s: float) -> list[str]:
        return [
            sys.executable, "-m", "gateway.cli", "worker", "--redis-url", redis_url, "--key-prefix", key_prefix,
            "--log-level", self.log_level,
            "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port), "--shutdown-grace-s", str(grace_s),
            *config_argv(self.worker, self.flags),
        ]


def check_worker_device(device: str) -> None:
    """Raise ValueError, in the words `carpool generate` uses, unless torch sees `device` on this machine.

    Asked of a child process (``worker.engine.device_check``) because this process, the gateway's, never imports
    torch; done before up starts anything, so that a missing GPU is said at once rather than after Redis, the
    gateway and the worker's imports. A CPU is always there, and costs no child.
    """
    if device == "cpu":
        return
    done = subprocess.run([sys.executable, "-m", "worker.engine.device_check", device], capture_output=True,
                          text=True)
    if done.returncode != 0:
        # Its one line; or, where the check failed before it could say why (torch's import broke), the last.
        lines = done.stderr.strip().splitlines()
        raise ValueError(lines[-1] if lines else f"device: cannot check {device} (exit {done.returncode})")


def child_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The worker child's environment: up's own, less every ``CARPOOL_*`` variable.

    `up` read those once, for itself and its worker, and hands the worker each setting as a flag; a variable the
    child read on its own (``CARPOOL_KEY_PREFIX``, a service setting `up` does not take) would set the worker
    apart from the gateway it serves.
    """
    return {name: value for name, value in environ.items() if not name.startswith("CARPOOL_")}


async def wait_ready(worker: asyncio.subprocess.Process, url: str, timeout_s: float, stop: asyncio.Event,
                     on_redis_wait: Callable[[], None] | None = None) -> bool:
    """True once the worker answers ready; False if it exited or we were told to stop first. `on_redis_wait` is
    called once if the worker, its model loaded, answers that it waits for Redis.

    Only an answer that names the worker's pid counts: another server on its port (or the gateway's own /readyz)
    may answer 200 too."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while not stop.is_set() and worker.returncode is None:
            try:
                async with session.get(url) as resp:
                    readyz = await resp.json(content_type=None)
                    if resp.status == 200 and _is_own(readyz, worker.pid):
                        return True
                    if on_redis_wait is not None and _is_own(readyz, worker.pid) and readyz.get("redis") != "ok":
                        on_redis_wait()
                        on_redis_wait = None
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
                pass  # not listening yet: the model is still loading
            if loop.time() > deadline:
                raise StackError(f"the worker was not ready after {timeout_s:g}s ({url})")
            try:
                await asyncio.wait_for(stop.wait(), READY_POLL_S)
            except TimeoutError:
                pass
    return False


def _is_own(readyz: object, pid: int) -> bool:
    """Whether a /readyz answer is the worker's with this pid."""
    return isinstance(readyz, dict) and readyz.get("pid") == pid


async def running_jobs(readyz_url: str, pid: int) -> int | None:
    """How many jobs the worker `pid` runs, from its /readyz (None when it does not answer, or another does)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            async with session.get(readyz_url) as resp:
                readyz = await resp.json(content_type=None)
                return int(readyz["running"]) if _is_own(readyz, pid) else None
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, TypeError):
        return None


async def stop_worker(worker: asyncio.subprocess.Process, grace_s: float, readyz_url: str,
                      hurry: asyncio.Event) -> int:
    """SIGTERM, then wait up to the grace period (saying for what); `hurry` (a second Ctrl-C) sends
    SIGINT, and the worker hands its jobs back at once. Returns its exit status (negative: the signal that
    ended it), or that of a worker that had exited already."""
    if worker.returncode is not None:
        return worker.returncode
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s + KILL_AFTER_S
    exited = asyncio.create_task(worker.wait())
    hurried = asyncio.create_task(hurry.wait())
    try:
        worker.send_signal(signal.SIGTERM)
        is_hurried = False
        while not exited.done() and loop.time() < deadline:
            if not is_hurried:
                running = await running_jobs(readyz_url, worker.pid)
                if running:
                    print(f"carpool: waiting up to {max(0.0, deadline - KILL_AFTER_S - loop.time()):.0f}s for the "
                          f"worker's {running} running job(s) to finish; Ctrl-C again hands them back now", flush=True)
            await asyncio.wait({exited, hurried}, timeout=min(STATUS_EVERY_S, max(0.0, deadline - loop.time())),
                               return_when=asyncio.FIRST_COMPLETED)
            if hurried.done() and not is_hurried and not exited.done():
                is_hurried = True
                print("carpool: handing the running jobs back now", flush=True)
                worker.send_signal(signal.SIGINT)  # not a second SIGTERM: two of one kind may merge into one
    finally:
        await cancel_and_reap(hurried)
    if not exited.done():
        print("carpool: the worker did not stop in time; killing it", file=sys.stderr)
        worker.kill()
    code = await exited
    print(f"carpool: worker stopped ({code})", flush=True)
    return code
