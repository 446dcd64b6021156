"""A stack as ``carpool up`` runs it, each part its own process: a bundled redis-server, a gateway, a worker.

The benchmark's client runs in the calling process, so whatever it measures
is not slowed by the gateway's or the worker's work in its own event loop.
The worker can be restarted between phases (a cold KV and prefix cache).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import BinaryIO

import aiohttp

from gateway.cli.embedded_redis import EmbeddedRedis, free_port

READY_TIMEOUT_S = 300.0


class ProcessStack:
    def __init__(self, model: str | None, worker_args: list[str], gateway_args: list[str]) -> None:
        self.model = model
        self.worker_args = worker_args
        self.gateway_args = gateway_args
        self._tmp = tempfile.TemporaryDirectory(prefix="carpool-bench-")
        self.redis = EmbeddedRedis(Path(self._tmp.name) / "redis", is_persistent=False)
        self.port = free_port()
        self.metrics_port = free_port()
        self._gateway: asyncio.subprocess.Process | None = None
        self._worker: asyncio.subprocess.Process | None = None
        self._logs: list[BinaryIO] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> ProcessStack:
        self.redis.start()
        try:
            self._gateway = await self._spawn("gateway", [
                "gateway", "--redis-url", self.redis.url, "--port", str(self.port), "--no-webhooks",
                "--log-level", "WARNING", *self.gateway_args])
            await self._wait_ready(self._gateway, f"{self.base_url}/readyz", "gateway")
            await self.start_worker()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def start_worker(self) -> None:
        await self.stop_worker()
        self._worker = await self._spawn("worker", [
            "worker", "--redis-url", self.redis.url, *(["--model", self.model] if self.model else []),
            "--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_port), "--log-level", "WARNING",
            "--shutdown-grace-s", "5", *self.worker_args])
        await self._wait_ready(self._worker, f"http://127.0.0.1:{self.metrics_port}/readyz", "worker")

    async def stop_worker(self) -> None:
        if self._worker is not None:
            await _stop(self._worker)
            self._worker = None

    async def _spawn(self, name: str, args: list[str]) -> asyncio.subprocess.Process:
        log = (Path(self._tmp.name) / f"{name}.log").open("ab")
        self._logs.append(log)
        return await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway.cli", *args,
                                                    stdout=asyncio.subprocess.DEVNULL, stderr=log)

    async def _wait_ready(self, process: asyncio.subprocess.Process, url: str, name: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while time.monotonic() < deadline:
                if process.returncode is not None:
                    tail = (Path(self._tmp.name) / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"the benchmark's {name} exited with {process.returncode}:\n{tail}")
                try:
                    async with session.get(url) as resp:
                        if resp.status == 200:
                            return
                except (aiohttp.ClientError, OSError, TimeoutError):
                    pass  # still starting
                await asyncio.sleep(0.2)
        raise RuntimeError(f"the benchmark's {name} was not ready after {READY_TIMEOUT_S:g}s")

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.stop_worker()
            if self._gateway is not None:
                await _stop(self._gateway)
        finally:
            for log in self._logs:
                log.close()
            self.redis.stop()
            self._tmp.cleanup()


async def _stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 30)
        except TimeoutError:
            process.kill()
            await process.wait()
