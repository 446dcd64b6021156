"""Helpers for the worker tests: a worker running in the test's event loop, direct XADDs, waits."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from scheduler.protocol.job import TERMINAL_STATUSES, JobSpec
from scheduler.protocol.job_record import job_view
from scheduler.protocol.keys import Keys

KEYS = Keys()
TERMINAL = {s.value for s in TERMINAL_STATUSES}
WAIT_S = 240.0
"""How long a wait on a condition may take before the test fails: generous, since tests assert what happens,
never how fast (a loaded CI box runs them many times slower than an idle laptop)."""
POLL_S = 0.002
"""Between two looks at state in this process."""
REDIS_POLL_S = 0.005
"""Between two looks at state in Redis."""


async def xadd_job(client: aioredis.Redis, spec: JobSpec) -> str:
    entry_id = await client.xadd(KEYS.lane(spec.lane), {"job": spec.pack()})
    return entry_id.decode()


async def status_of(client: aioredis.Redis, job_id: str) -> str | None:
    raw = await client.hget(KEYS.job(job_id), "status")
    return None if raw is None else raw.decode()


async def has_status(client: aioredis.Redis, job_id: str, status: str) -> bool:
    return await status_of(client, job_id) == status


async def wait_until(condition: Callable[[], bool | Awaitable[bool]], what: str, timeout_s: float = WAIT_S) -> None:
    """Return once ``condition()`` (plain or awaitable) holds; fails the test, saying ``what``, on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = condition()
        poll_s = POLL_S
        if inspect.isawaitable(held):
            held, poll_s = await held, REDIS_POLL_S
        if held:
            return
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(poll_s)


async def kill_holding(proc: subprocess.Popen[bytes], ready: Callable[[], Awaitable[bool]],
                       held_jobs: Callable[[], Awaitable[list[str]]], what: str) -> list[str]:
    """SIGKILL `proc` (a crash: no drain, no hand-back) once `ready()` holds, at a moment `held_jobs()` names
    some; returns those.

    The process is frozen (SIGSTOP) before `held_jobs()` reads Redis, so what it holds cannot change between that
    read and the kill, at any engine speed; when it holds nothing at that moment (between two jobs), it goes on
    and the wait starts again."""
    while True:
        await wait_until(ready, what)
        proc.send_signal(signal.SIGSTOP)
        held: list[str] = []
        try:
            held = await held_jobs()
        finally:
            if not held:  # also when the read failed: a frozen process would not stop at the test's cleanup
                proc.send_signal(signal.SIGCONT)
        if held:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return held


async def wait_terminal(client: aioredis.Redis, ids: Iterable[str], timeout_s: float = WAIT_S) -> dict[str, dict[str, Any]]:
    """Every job's public view once all are terminal; fails the test on timeout."""
    pending = list(ids)
    deadline = time.monotonic() + timeout_s
    while True:
        async with client.pipeline(transaction=False) as pipe:
            for job_id in pending:
                pipe.hget(KEYS.job(job_id), "status")
            statuses = [None if raw is None else raw.decode() for raw in await pipe.execute()]
        if all(s in TERMINAL for s in statuses):
            return {i: job_view(await client.hgetall(KEYS.job(i))) for i in pending}
        if time.monotonic() > deadline:
            left = {i: s for i, s in zip(pending, statuses) if s not in TERMINAL}
            raise AssertionError(f"{len(left)} jobs not finished in {timeout_s}s: {dict(list(left.items())[:5])}")
        await asyncio.sleep(REDIS_POLL_S)


class StepLog:
    """An engine runner that ticks a real in-process engine on its thread and notes engine steps per job.

    ``added_at[id]`` is the engine step that first ran a job, ``finished_at[id]`` the step that ended it,
    so a test can count a job's life in engine steps, whatever the engine's speed.
    """

    def __init__(self, engine: Any) -> None:
        from worker.engine.tick import EngineThread

        self.engine = engine
        self.max_num_seqs: int = engine.max_num_seqs
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.vocab_size
        self.added_at: dict[str, int] = {}
        self.finished_at: dict[str, int] = {}
        self.failure: BaseException | None = None
        self._thread = EngineThread(engine)

    def tick(self, adds: list[Any], aborts: list[str], do_step: bool) -> asyncio.Future[Any]:
        future = self._thread.tick(adds, aborts, do_step)
        added = [add[0] for add in adds]

        def note(done: asyncio.Future[Any]) -> None:
            if done.cancelled() or done.exception() is not None:
                return
            tick = done.result()
            for job_id in added:
                if job_id not in tick.rejected:
                    self.added_at.setdefault(job_id, tick.stats.num_steps)
            for out in tick.outputs:
                if out.finished:
                    self.finished_at[out.request_id] = tick.stats.num_steps

        future.add_done_callback(note)
        return future

    async def aclose(self) -> None:
        await self._thread.aclose()


class HeldReplies:
    """An engine runner that ticks a real in-process engine on its thread and lets the test hold its replies:
    after ``hold(n)`` only ``n`` more replies reach the worker until ``release()``. Notes every tick sent: the
    jobs it adds, whether it steps, and how many ticks were out unanswered when it was sent. What the worker
    does while replies are held is then fixed by construction, whatever the engine's speed."""

    def __init__(self, engine: Any) -> None:
        from worker.engine.tick import EngineThread

        self.max_num_seqs: int = engine.max_num_seqs
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.vocab_size
        self.sent: list[tuple[list[str], bool, int]] = []
        self.failure: BaseException | None = None
        self.unanswered = 0
        self._passes: int | None = None
        self._changed = asyncio.Condition()
        self._thread = EngineThread(engine)

    async def hold(self, passes: int = 0) -> None:
        async with self._changed:
            self._passes = passes

    async def release(self) -> None:
        async with self._changed:
            self._passes = None
            self._changed.notify_all()

    def tick(self, adds: list[Any], aborts: list[str], do_step: bool) -> asyncio.Future[Any]:
        self.sent.append(([add[0] for add in adds], do_step, self.unanswered))
        self.unanswered += 1
        inner = self._thread.tick(adds, aborts, do_step)

        async def reply() -> Any:
            result = await inner
            async with self._changed:
                await self._changed.wait_for(lambda: self._passes is None or self._passes > 0)
                if self._passes is not None:
                    self._passes -= 1
            self.unanswered -= 1
            return result

        return asyncio.ensure_future(reply())

    async def aclose(self) -> None:
        await self.release()
        await self._thread.aclose()


@asynccontextmanager
async def running_worker(redis_url: str, engine: Any, **overrides: Any) -> AsyncIterator[Any]:
    """A WorkerService on `engine` inside this event loop; shut down (two phases) on exit."""
    from worker.config import WorkerConfig
    from worker.engine.engine import Engine
    from worker.engine.tick import EngineThread
    from worker.service import WorkerService

    settings: dict[str, Any] = {"redis_url": redis_url, "metrics_port": 0, "max_wait_ms": 5.0,
                                "max_num_seqs": engine.max_num_seqs, "shutdown_grace_s": 5.0}
    settings.update(overrides)
    config = WorkerConfig.of(**settings)
    client = aioredis.Redis.from_url(redis_url)
    # A real in-process engine runs on its thread, as `carpool worker --no-engine-process` runs it.
    runner = EngineThread(engine) if isinstance(engine, Engine) else engine
    service = WorkerService(config, runner, client)
    await service.start()
    try:
        yield service
    finally:
        await service.shutdown()
        await client.aclose()


def start_worker_process(redis_url: str, model: str, name: str, log_path: Path, *flags: str) -> subprocess.Popen[bytes]:
    """``carpool worker`` as a child process (its output appended to `log_path`): 8 slots, a 2 s lease, frequent
    checkpoints; `flags` add to or override those."""
    from tests.harness.child_env import child_pythonpath

    root = Path(__file__).resolve().parents[2]
    args = [sys.executable, "-m", "worker.cli", "worker", "--redis-url", redis_url, "--model", model,
            "--worker-name", name, "--metrics-port", "0", "--max-num-seqs", "8", "--lease-s", "2",
            "--checkpoint-tokens", "4", "--checkpoint-interval-s", "0.2", "--max-wait-ms", "5", *flags]
    env = {**os.environ, "PYTHONPATH": child_pythonpath(root)}
    with open(log_path, "ab") as log:
        return subprocess.Popen(args, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
