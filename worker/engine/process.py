"""The engine in a child process, so its steps never wait for the GIL of the worker's event loop.

On one thread, the engine's step and the event loop's Redis I/O, leases,
metrics and token events take turns holding the GIL: a worker then uses one
core however many it has. Here the child builds the engine and serves ticks
over a socket pair; per tick the parent only pickles the request and
unpickles the reply.

Ticks are pipelined: the parent may send the next tick before the reply to
the last one has arrived, so the child starts its next step the moment it
has sent a reply. Before each step the child reads every tick already sent
and takes their jobs and aborts in at once: a job sent while two steps are
queued starts in the next step, not two steps later (each tick still gets
its own step and its reply, in order; a job's rejection comes with the
reply of the step it was taken into). The parent's side of the socket is an asyncio transport:
its writes are buffered and never block the event loop, and replies are
read while a large request is still going out, so a large request and a
large reply cannot wait on each other.

The child is started with ``spawn`` (forking a process that loaded torch is
unsafe). It exits when told to, when the socket reaches EOF (its parent
died), or, on Linux, by SIGKILL the moment its parent dies. It ignores
SIGINT and SIGTERM: a Ctrl-C to the process group must not kill the engine
while the parent still drains through it.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import multiprocessing
import os
import pickle
import select
import signal
import socket
import struct
import traceback
from collections import deque
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from scheduler.runtime.parent_death import die_with_parent
from scheduler.telemetry.log_format import LogSettings, configure_logging
from worker.engine.config import EngineConfig
from worker.engine.tick import run_tick
from worker.engine.wire import Add, EngineError, EngineFailed, EngineMessage, EngineReady, Tick, TickRequest

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
"""How long a stopping child may take to finish its ticks and exit before it is killed."""
FRAME_HEADER = struct.Struct("!Q")
"""Each message on the socket: its pickle's length, then the pickle."""


class EngineStartError(RuntimeError):
    """The child could not build the engine (bad model path, bad setting); the message says why."""


def frame(message: TickRequest | EngineMessage | None) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME_HEADER.pack(len(data)) + data


class _Channel(asyncio.Protocol):
    """The parent's end of the socket: cuts the byte stream into messages and hands each to ``on_message``."""

    def __init__(self, on_message: Callable[[EngineMessage], None], on_lost: Callable[[Exception | None], None]) -> None:
        self.on_message = on_message
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while len(self._buffer) >= FRAME_HEADER.size:
            (size,) = FRAME_HEADER.unpack_from(self._buffer)
            end = FRAME_HEADER.size + size
            if len(self._buffer) < end:
                return
            message = pickle.loads(self._buffer[FRAME_HEADER.size:end])
            del self._buffer[:end]
            self.on_message(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self.on_lost(exc)


class EngineProcess:
    """The parent's handle on an engine child: ``tick`` round trips, ``aclose`` stops it.

    Requests go out as soon as they are asked for; the child answers them one at a time, in order.
    """

    def __init__(self, process: BaseProcess, max_num_seqs: int = 0, max_model_len: int = 0, vocab_size: int = 0) -> None:
        self.process = process
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._channel: _Channel | None = None
        self._ready: asyncio.Future[EngineReady] | None = None
        self._waiting: deque[asyncio.Future[Tick] | None] = deque()
        """Requests sent and not yet answered, oldest first; None: the stop message."""
        self._failure: EngineFailed | None = None
        self._stopping = False

    @property
    def pid(self) -> int:
        assert self.process.pid is not None, "started in start()"
        return self.process.pid

    @classmethod
    async def start(cls, config: EngineConfig, torch_threads: int, log: LogSettings | None = None) -> EngineProcess:
        """Spawn the child and wait until its engine is built; raises ``EngineStartError`` if it cannot be. `log`:
        how the child logs (None: Python's default, warnings and worse on stderr)."""
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        context = multiprocessing.get_context("spawn")
        process = context.Process(target=serve_engine, name="carpool-engine", daemon=True,
                                  args=(theirs, config, torch_threads, os.getpid(), log))
        # Started from the event loop's thread, the main one: Linux sends the death signal when the thread
        # that started the child ends, so a short-lived thread must not start it.
        try:
            process.start()
        finally:
            theirs.close()  # only the child holds its end now: its death is EOF here
        engine = cls(process)
        engine._ready = loop.create_future()
        try:
            _, channel = await loop.create_unix_connection(lambda: _Channel(engine._on_message, engine._on_lost),
                                                           sock=ours)
            engine._channel = channel
            ready = await engine._ready
            engine.max_num_seqs, engine.max_model_len, engine.vocab_size = (
                ready.max_num_seqs, ready.max_model_len, ready.vocab_size)
        except BaseException as e:
            process.kill()
            await loop.run_in_executor(None, process.join, STOP_TIMEOUT_S)
            if engine._channel is None:
                ours.close()
            engine._close_channel()
            if isinstance(e, EOFError):
                raise EngineStartError(
                    f"the engine process exited with code {process.exitcode} before it was ready") from None
            raise
        return engine

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def tick(self, adds: list[Add], aborts: list[str], do_step: bool) -> asyncio.Future[Tick]:
        future: asyncio.Future[Tick] = asyncio.get_running_loop().create_future()
        if self._failure is not None:
            future.set_exception(self._failure)
            return future
        if self._stopping:
            future.set_exception(EngineFailed(f"the engine process (pid {self.pid}) is stopping"))
            return future
        self._waiting.append(future)
        self._send(TickRequest(adds, aborts, do_step))
        return future

    def _send(self, message: TickRequest | None) -> None:
        assert self._channel is not None and self._channel.transport is not None
        self._channel.transport.write(frame(message))  # buffered: never blocks the event loop

    def _on_message(self, message: EngineMessage) -> None:
        if self._ready is not None and not self._ready.done():
            if isinstance(message, EngineReady):
                self._ready.set_result(message)
            else:
                assert isinstance(message, EngineError), message
                self._ready.set_exception(EngineStartError(message.message))
            return
        future = self._waiting.popleft()
        if future is None or future.done():
            return
        if isinstance(message, EngineError):
            future.set_exception(EngineFailed(f"the engine raised in its process (pid {self.pid}):\n{message.message}"))
        else:
            assert isinstance(message, Tick), message
            future.set_result(message)

    def _on_lost(self, exc: Exception | None) -> None:
        """EOF or a socket error: the child is gone (or exiting as asked)."""
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EOFError("the engine process closed its socket before it was ready"))
            return
        if self._waiting and self._waiting[0] is None:
            return  # every tick asked for is answered: the child exits as asked
        self.process.join(0.5)  # for its exit code; a closed socket means it is exiting
        failure = EngineFailed(f"the engine process (pid {self.pid}) exited with code {self.process.exitcode}")
        failure.__cause__ = exc
        self._failure = failure
        while self._waiting:
            future = self._waiting.popleft()
            if future is not None and not future.done():
                future.set_exception(failure)

    def _close_channel(self) -> None:
        if self._channel is not None and self._channel.transport is not None:
            self._channel.transport.close()

    async def aclose(self) -> None:
        """Stop the child after the ticks already asked for; kill it if it takes longer than ``STOP_TIMEOUT_S``."""
        loop = asyncio.get_running_loop()
        if self._failure is None and not self._stopping:
            self._stopping = True
            self._waiting.append(None)  # after the ticks in flight, not between them
            self._send(None)
        await loop.run_in_executor(None, self.process.join, STOP_TIMEOUT_S)
        if self.process.is_alive():
            log.warning("the engine process (pid %d) did not stop in %.0fs; killing it", self.pid, STOP_TIMEOUT_S)
            self.process.kill()
            await loop.run_in_executor(None, self.process.join, STOP_TIMEOUT_S)
        self._close_channel()
        self._waiting.clear()


def serve_engine(sock: socket.socket, config: EngineConfig, torch_threads: int, parent_pid: int,
                 log: LogSettings | None = None) -> None:
    """The child's body: build the engine, report ready (or why not), then answer ticks until told to stop.
    `log`: how to log (the worker's own settings)."""
    _die_with_parent(parent_pid)
    if log is not None:
        configure_logging(log.level, service=log.service, is_json=log.is_json)
    faulthandler.enable()  # a crash in native code (SIGSEGV, SIGABRT) prints where each thread was, to the log
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from worker.engine.startup_heap import freeze_startup_heap
    from worker.engine.torch_threads import apply_torch_threads

    with sock:
        try:
            apply_torch_threads(torch_threads, config.device)
            from worker.engine.engine import Engine

            engine = Engine(config)
        except Exception as e:
            sock.sendall(frame(EngineError(f"{type(e).__name__}: {e}")))
            return
        freeze_startup_heap()
        sock.sendall(frame(EngineReady(engine.max_num_seqs, engine.max_model_len, engine.vocab_size)))
        sent_ahead: deque[TickRequest | None] = deque()
        """Ticks read ahead of the one about to run; their jobs and aborts are already taken in."""
        while True:
            try:
                request = sent_ahead.popleft() if sent_ahead else _receive(sock)
                while request is not None and (not sent_ahead or sent_ahead[-1] is not None) and _readable(sock):
                    sent_ahead.append(_receive(sock))
            except (EOFError, OSError):
                return  # the parent is gone
            if request is None:
                return
            # A job sent with a later tick (a new interactive job, say) joins this step rather than waiting for
            # the step of every tick in between; the later ticks keep their steps, and reply in order.
            later = [(ahead.adds, ahead.aborts) for ahead in sent_ahead if ahead is not None]
            for i, ahead in enumerate(sent_ahead):
                if ahead is not None:
                    sent_ahead[i] = TickRequest([], [], ahead.do_step)
            try:
                reply: EngineMessage = run_tick(engine, request.adds, request.aborts, request.do_step, later)
            except Exception:
                reply = EngineError(traceback.format_exc())
            try:
                sock.sendall(frame(reply))
            except OSError:
                return


def _readable(sock: socket.socket) -> bool:
    """Whether the parent has sent more (a tick, the stop, or EOF) than has been read."""
    return bool(select.select([sock], [], [], 0)[0])


def _receive(sock: socket.socket) -> TickRequest | None:
    (size,) = FRAME_HEADER.unpack(_read_exactly(sock, FRAME_HEADER.size))
    request: TickRequest | None = pickle.loads(_read_exactly(sock, size))
    return request


def _read_exactly(sock: socket.socket, size: int) -> bytearray:
    data = bytearray(size)
    view = memoryview(data)
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise EOFError("the engine's parent closed the socket")
        view = view[n:]
    return data


def _die_with_parent(parent_pid: int) -> None:
    """Best effort: have Linux SIGKILL this process when its parent dies, even before the socket is read."""
    arm = die_with_parent(signal.SIGKILL, parent_pid)
    if arm is not None:
        arm()
    if os.getppid() != parent_pid:
        os._exit(0)  # the parent is gone (where no parent-death signal could be set)
