"""A TCP relay in front of a real redis-server that can fail like a crash: the one command got through, its reply never came back.

`trip(pattern)` arms it: the first client chunk holding `pattern` is forwarded to
Redis, then every connection is cut and new ones are refused (closed at once)
until `restore()`. Redis itself keeps running and keeps what that command wrote.
`refuse(*patterns)` arms the other fault: the first client chunk holding every pattern never reaches Redis,
and only its own connection is cut, as when a connection dies under one command; with `then_down=True`
every connection is cut with it and Redis stays unreachable until `restore()`, as in an outage that began
just before that command. `go_down()` starts such an outage at once. `go_silent()` is the quiet failure:
every open connection stays open but carries nothing more either way (a network path that drops
everything), while new connections work. `answer(*patterns, reply=...)` has the first client chunk holding every
pattern answered by the proxy instead of Redis, with a reply of the test's (an error another Redis version sends).
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit


class RedisProxy:
    def __init__(self, redis_url: str) -> None:
        parts = urlsplit(redis_url)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._pattern: bytes | None = None
        self._refused: tuple[bytes, ...] | None = None
        self._is_down_after_refusal = False
        self.num_refused = 0
        self._answered: tuple[tuple[bytes, ...], bytes] | None = None
        self.num_answered = 0
        self.is_down = False
        self._is_muted = False
        self.num_tripped = 0
        self._silent: set[asyncio.StreamWriter] = set()
        """Client sides of connections that carry nothing more."""
        self._open: set[asyncio.StreamWriter] = set()
        self.num_connections = 0

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0"

    async def start(self) -> RedisProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    def trip(self, pattern: bytes) -> None:
        self._pattern = pattern

    def refuse(self, *patterns: bytes, then_down: bool = False) -> None:
        self._refused = patterns
        self._is_down_after_refusal = then_down

    def answer(self, *patterns: bytes, reply: bytes) -> None:
        """The first client chunk holding every pattern never reaches Redis: the client gets `reply` (RESP, such
        as ``-UNBLOCKED …\r\n``) as if Redis had sent it, and its connection goes on."""
        self._answered = (patterns, reply)

    def go_down(self) -> None:
        """Cut every connection and refuse new ones until `restore()`."""
        self.is_down = True
        self._cut()

    def go_silent(self) -> None:
        """Every open connection stays open and carries nothing more, either way; new ones work."""
        self._silent |= self._open

    def restore(self) -> None:
        self.is_down = False
        self._is_muted = False

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        self._cut()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def _cut(self) -> None:
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.is_down:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        self._writers |= {writer, up_writer}
        self._open.add(writer)
        self.num_connections += 1
        pipes = [asyncio.create_task(self._pipe(reader, up_writer, is_request=True, client=writer)),
                 asyncio.create_task(self._pipe(up_reader, writer, is_request=False, client=writer))]
        self._tasks.update(pipes)
        await asyncio.gather(*pipes, return_exceptions=True)
        self._tasks.difference_update(pipes)
        self._open.discard(writer)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, is_request: bool,
                    client: asyncio.StreamWriter) -> None:
        try:
            while not self.is_down and (chunk := await reader.read(65536)):
                if client in self._silent:
                    continue  # the path drops it
                if is_request and self._answered is not None and all(p in chunk for p in self._answered[0]):
                    reply, self._answered = self._answered[1], None
                    self.num_answered += 1
                    client.write(reply)
                    await client.drain()
                    continue
                if is_request and self._refused is not None and all(p in chunk for p in self._refused):
                    self._refused = None
                    self.num_refused += 1
                    if self._is_down_after_refusal:
                        self.go_down()
                    return  # not forwarded; the finally clause closes this connection's upstream side
                is_trip = is_request and self._pattern is not None and self._pattern in chunk
                if is_trip:
                    self._pattern = None
                    self.num_tripped += 1
                    self._is_muted = True  # from now on no reply reaches a client
                if self._is_muted and not is_request:
                    continue
                writer.write(chunk)
                await writer.drain()
                if is_trip:
                    await asyncio.sleep(0.05)  # Redis runs the command; its reply is dropped with the cut
                    self.is_down = True
                    self._cut()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
