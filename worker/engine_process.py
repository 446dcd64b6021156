"""The engine in a child process, so its steps never wait for the GIL of the worker's event loop.

On one thread, the engine's step and the event loop's Redis I/O, leases,
metrics and token events take turns holding the GIL: a worker then uses one
core however many it has. Here the child builds the engine and serves ticks
over a pipe; per tick the parent only pickles the request and unpickles the
reply.

The child is started with ``spawn`` (forking a process that loaded torch is
unsafe). It exits when told to, when the pipe reaches EOF (its parent died),
or, on Linux, by SIGKILL the moment its parent dies. It ignores SIGINT and
SIGTERM: a Ctrl-C to the process group must not kill the engine while the
parent still drains through it.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import traceback
from collections import deque
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

from worker.engine_tick import Add, EngineFailed, StepOutput, Tick, run_tick

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
"""How long a stopping child may take to finish its tick and exit before it is killed."""
START_POLL_S = 0.5
PR_SET_PDEATHSIG = 1


class EngineStartError(RuntimeError):
    """The child could not build the engine (bad model path, bad setting); the message says why."""


class EngineProcess:
    """The parent's handle on an engine child: ``tick`` round trips, ``aclose`` stops it.

    The event loop's own thread writes requests and reads replies (a reader on the pipe): no thread
    hand-off sits between a reply and the next request, so the engine idles as little as possible.
    One request at a time is in the pipe; later ones wait here, in order.
    """

    def __init__(self, process: Any, conn: Connection, max_num_seqs: int) -> None:
        self.process = process
        self.max_num_seqs = max_num_seqs
        self._conn = conn
        self._waiting: deque[tuple[Any, asyncio.Future[Tick] | None]] = deque()
        """Requests not yet answered, oldest first (the first one is in the pipe); None: the stop message."""
        self._failure: EngineFailed | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    @classmethod
    async def start(cls, engine_kwargs: dict[str, Any], torch_threads: int, device: str) -> EngineProcess:
        """Spawn the child and wait until its engine is built; raises ``EngineStartError`` if it cannot be."""
        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe(duplex=True)
        process = context.Process(target=serve_engine, name="carpool-engine", daemon=True,
                                  args=(child_conn, engine_kwargs, torch_threads, device, os.getpid()))
        # Started from the event loop's thread, the main one: Linux sends the death signal when the thread
        # that started the child ends, so a short-lived thread must not start it.
        process.start()
        child_conn.close()  # only the child holds its end now: its death is EOF here
        try:
            ready = await asyncio.get_running_loop().run_in_executor(None, _wait_ready, process, conn)
        except BaseException:
            process.kill()
            process.join(STOP_TIMEOUT_S)
            conn.close()
            raise
        return cls(process, conn, ready)

    def tick(self, adds: list[Add], aborts: list[str], do_step: bool) -> asyncio.Future[Tick]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Tick] = loop.create_future()
        if self._failure is not None:
            future.set_exception(self._failure)
            return future
        if self._loop is None:
            self._loop = loop
            loop.add_reader(self._conn.fileno(), self._on_reply)
        self._waiting.append(((adds, aborts, do_step), future))
        if len(self._waiting) == 1:
            self._send_next()
        return future

    def _send_next(self) -> None:
        if not self._waiting:
            return
        request, _ = self._waiting[0]
        try:
            self._conn.send(request)
        except OSError as e:
            self._fail(e)

    def _on_reply(self) -> None:
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError) as e:
            if self._waiting and self._waiting[0][1] is None:
                self._stop_reading()  # the child exits as asked
            else:
                self._fail(e)
            return
        request, future = self._waiting.popleft()
        if future is not None and not future.done():
            if kind == "error":
                future.set_exception(EngineFailed(f"the engine raised in its process (pid {self.pid}):\n{payload}"))
            else:
                assert kind == "tick" and isinstance(payload, Tick), kind
                future.set_result(payload)
        self._send_next()

    def _fail(self, cause: BaseException) -> None:
        """The child is gone: every waiting tick fails, and so does every later one."""
        self.process.join(0.5)  # for its exit code; a closed pipe means it is exiting
        failure = EngineFailed(f"the engine process (pid {self.pid}) exited with code {self.process.exitcode}")
        failure.__cause__ = cause
        self._failure = failure
        self._stop_reading()
        while self._waiting:
            _, future = self._waiting.popleft()
            if future is not None and not future.done():
                future.set_exception(failure)

    def _stop_reading(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._conn.fileno())
            self._loop = None

    async def aclose(self) -> None:
        """Stop the child after the ticks already asked for; kill it if it takes longer than ``STOP_TIMEOUT_S``."""
        loop = asyncio.get_running_loop()
        if self._failure is None and not self._conn.closed:
            # The stop message (None) queues behind ticks in flight instead of interleaving with them.
            self._waiting.append((None, None))
            if len(self._waiting) == 1:
                self._send_next()
        await loop.run_in_executor(None, self.process.join, STOP_TIMEOUT_S)
        if self.process.is_alive():
            log.warning("the engine process (pid %d) did not stop in %.0fs; killing it", self.pid, STOP_TIMEOUT_S)
            self.process.kill()
            await loop.run_in_executor(None, self.process.join, STOP_TIMEOUT_S)
        self._stop_reading()
        self._waiting.clear()
        self._conn.close()


def _wait_ready(process: Any, conn: Connection) -> int:
    while not conn.poll(START_POLL_S):
        if not process.is_alive():
            raise EngineStartError(f"the engine process exited with code {process.exitcode} before it was ready")
    try:
        kind, payload = conn.recv()
    except EOFError as e:
        process.join(1.0)
        raise EngineStartError(f"the engine process exited with code {process.exitcode} before it was ready") from e
    if kind == "error":
        raise EngineStartError(payload)
    assert kind == "ready", kind
    return int(payload)


def serve_engine(conn: Connection, engine_kwargs: dict[str, Any], torch_threads: int, device: str,
                 parent_pid: int) -> None:
    """The child's body: build the engine, report ready (or why not), then answer ticks until told to stop."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from worker.torch_threads import apply_torch_threads

    try:
        apply_torch_threads(torch_threads, device)
        from worker.engine import Engine

        engine = Engine(**engine_kwargs)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", engine.max_num_seqs))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if request is None:
            return
        try:
            reply: tuple[str, Any] = ("tick", _portable(run_tick(engine, *request)))
        except Exception:
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except OSError:
            return


def _portable(tick: Tick) -> Tick:
    """The tick with torch-free outputs and stats: unpickling engine classes would import torch into the
    parent, on its event loop's thread, for seconds (long enough to lose leases)."""
    outputs = [StepOutput(out.request_id, out.new_token_ids, out.token_ids, out.text, out.logprobs, out.finished,
                          out.finish_reason, out.num_prompt_tokens, out.num_cached_tokens) for out in tick.outputs]
    return Tick(tick.rejected, outputs, tick.num_unfinished, SimpleNamespace(**dataclasses.asdict(tick.stats)))


def _die_with_parent(parent_pid: int) -> None:
    """Best effort: have Linux SIGKILL this process when its parent dies, even before the pipe is read."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os._exit(0)  # the parent died before the setting took effect
