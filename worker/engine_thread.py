"""The thread that owns the engine and steps it back to back while it has work.

With a tiny model a step takes a few milliseconds, so handing every step back
to the event loop (result to the loop, resume the coroutine, submit the next
step) leaves the engine idle for a large share of the time. Here the engine
never waits for the loop: adds and aborts are queued to the thread and applied
at the start of its next step, and each step's ``Tick`` is handed to the loop
with ``call_soon_threadsafe``. The loop handles ticks in order, possibly a few
steps behind the engine; at most ``max_ticks_ahead`` ticks may be unhandled
before the thread waits, so a slow loop cannot make memory grow without bound.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scheduler.job import JobSpec

log = logging.getLogger(__name__)

IDLE_STEP_SLEEP_S = 0.002
"""How long to wait before stepping again while the engine holds all its work back."""

MAX_TICKS_AHEAD = 4


@dataclass
class Tick:
    """What one engine step did."""

    rejected: dict[str, str]
    """Adds the engine refused: request id -> reason."""
    outputs: list[Any]
    num_unfinished: int
    stats: Any
    """The engine's ``EngineStats`` after the step."""


@dataclass
class EngineAdd:
    request_id: str
    spec: JobSpec
    priority: int
    resume_token_ids: list[int]


class EngineFailed(RuntimeError):
    """The engine thread died; the worker can no longer run jobs."""


Delivery = Tick | EngineFailed


class EngineThread:
    """Runs ``engine`` on its own thread; every engine call happens there.

    ``add`` and ``abort`` may be called from any thread and are applied in the
    order given, at the start of the next step: an abort queued after an add of
    the same id removes that request again. ``deliver`` is called on the engine
    thread with each ``Tick``, in step order, and once with ``EngineFailed`` if
    the engine raises; the receiver calls ``handled`` after each tick.
    """

    def __init__(self, engine: Any, *, max_wait_s: float = 0.0, idle_sleep_s: float = IDLE_STEP_SLEEP_S,
                 max_ticks_ahead: int = MAX_TICKS_AHEAD) -> None:
        assert max_ticks_ahead >= 1
        self.engine = engine
        self.max_wait_s = max_wait_s
        self.idle_sleep_s = idle_sleep_s
        self.max_ticks_ahead = max_ticks_ahead
        self._cond = threading.Condition()
        self._ops: list[EngineAdd | str] = []
        self._room = True
        self._unhandled = 0
        self._queued = 0
        self._applied = 0
        """Adds and aborts queued so far, and how many of them the engine has seen."""
        self._stopping = False
        self._thread: threading.Thread | None = None

    # --- any thread ----------------------------------------------------------------------

    def add(self, request: EngineAdd, *, room_left: bool = True) -> None:
        """Queue a request; ``room_left`` False ends the admission window (no more jobs will come)."""
        with self._cond:
            self._ops.append(request)
            self._queued += 1
            self._room = room_left
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._ops.append(request_id)
            self._queued += 1
            self._cond.notify()

    def wait_applied(self, timeout_s: float) -> bool:
        """Block until the engine has seen every add and abort queued so far (False: it did not in time).

        Blocking: call it off the event loop.
        """
        with self._cond:
            target = self._queued
            return self._cond.wait_for(lambda: self._applied >= target or not self.is_alive, timeout=timeout_s) \
                and self._applied >= target

    def handled(self) -> None:
        """The receiver is done with one tick."""
        with self._cond:
            self._unhandled -= 1
            assert self._unhandled >= 0
            self._cond.notify()

    def start(self, deliver: Callable[[Delivery], object]) -> None:
        assert self._thread is None, "started twice"
        self._thread = threading.Thread(target=self._main, args=(deliver,), name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end after its current step; ``join`` waits for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the thread to end (blocking: off the event loop); True once it has."""
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- the engine thread -------------------------------------------------------------------

    def _main(self, deliver: Callable[[Delivery], object]) -> None:
        try:
            self._loop(deliver)
        except BaseException as e:  # a dead engine must reach the loop, whatever killed it
            log.error("the engine thread failed", exc_info=e)
            failure = EngineFailed(f"engine thread failed: {type(e).__name__}: {e}")
            failure.__cause__ = e
            try:
                deliver(failure)
            except RuntimeError:
                pass  # the event loop is closed already: nobody is left to tell

    def _loop(self, deliver: Callable[[Delivery], object]) -> None:
        while True:
            ops = self._next_ops()
            if ops is None:
                return
            tick = self._step(ops)
            with self._cond:
                self._unhandled += 1
            try:
                deliver(tick)
            except RuntimeError:
                return  # the event loop closed under us: the worker is gone
            if tick.num_unfinished and not tick.outputs and tick.stats.last_step_num_seqs == 0:
                # The engine holds its work back (dynamic batching window): do not spin; a new add wakes us.
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping or bool(self._ops), timeout=self.idle_sleep_s)

    def _next_ops(self) -> list[EngineAdd | str] | None:
        """Wait until there is something to do and room for another tick; None when told to stop."""
        busy = self.engine.has_unfinished_requests()
        with self._cond:
            if not busy and not self._ops:
                self._cond.wait_for(lambda: self._stopping or bool(self._ops))
                # Admission window: an idle engine waits briefly so jobs arriving together start together.
                adding = any(isinstance(op, EngineAdd) for op in self._ops)
                if adding and self.max_wait_s > 0 and self._room and not self._stopping:
                    self._cond.wait_for(lambda: self._stopping or not self._room, timeout=self.max_wait_s)
            self._cond.wait_for(lambda: self._stopping or self._unhandled < self.max_ticks_ahead)
            if self._stopping:
                # Aborts still queued are applied: a request handed back must not stay in the engine.
                for op in self._ops:
                    if isinstance(op, str):
                        self.engine.abort_request(op)
                self._ops = []
                return None
            ops, self._ops = self._ops, []
            return ops

    def _step(self, ops: list[EngineAdd | str]) -> Tick:
        rejected: dict[str, str] = {}
        for op in ops:
            if isinstance(op, str):
                self.engine.abort_request(op)
                rejected.pop(op, None)
                continue
            spec = op.spec
            try:
                self.engine.add_request(
                    op.request_id, spec.prompt if spec.prompt is not None else spec.prompt_token_ids, spec.params,
                    messages=spec.messages, priority=op.priority, resume_token_ids=op.resume_token_ids or None,
                )
            except ValueError as e:
                rejected[op.request_id] = str(e)
        with self._cond:
            self._applied += len(ops)
            self._cond.notify_all()
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        return Tick(rejected, outputs, self.engine.num_unfinished_requests(), self.engine.stats())
