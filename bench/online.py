"""Through the queue: HTTP submissions with Poisson arrivals to a gateway, Redis lanes, a worker process.

The stack is real: a bundled redis-server, the gateway app on a loopback
port (in this process: it only forwards), and ``carpool worker`` as a child
process with the batching mode under test. Jobs are submitted with
``POST /v1/jobs`` and name a ``reply_to`` stream, on which the worker puts
each final job record; their timings (created, started, first token,
finished) measure the whole path, queue included. Inter-token latency per job is its decode
time over its tokens after the first (the record holds no per-token times).
"""

from __future__ import annotations

import asyncio
import re
import uuid
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import aiohttp
import msgpack
import redis.asyncio as aioredis
from aiohttp import web

from bench.records import RequestTiming, RunResult, Sample
from bench.workloads import Workload
from gateway.app import init_app
from gateway.cli.embedded_redis import EmbeddedRedis, free_port
from gateway.config import GatewayConfig
from scheduler.protocol.redis_replies import stream_entries

WORKER_READY_TIMEOUT_S = 300.0
RESULTS_TIMEOUT_S = 900.0
SUBMIT_CONNECTIONS = 16
"""The client's HTTP connection pool, kept alive across submissions, as a producer's would be: an unbounded
pool opens one connection per request at saturation, and the run would time 64 TCP handshakes."""
PREEMPTIONS_METRIC = re.compile(r"^carpool_engine_preemptions[a-z_]*(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M)


class OnlineStack:
    """Redis + gateway + one worker for one batching mode; an async context manager."""

    def __init__(self, model: str, batching: str, max_num_seqs: int, max_wait_ms: float = 20.0,
                 child_env: Mapping[str, str] | None = None, read_block_ms: int = 20, device: str = "cpu",
                 dtype: str | None = None, api_keys: bool = False) -> None:
        """``api_keys``: run the gateway with keys required (the caller makes the keys)."""
        self.api_keys = api_keys
        self.model = model
        self.device = device
        self.dtype = dtype
        self.child_env = dict(child_env) if child_env is not None else None
        self.read_block_ms = read_block_ms
        self.batching = batching
        self.max_num_seqs = max_num_seqs
        self.max_wait_ms = max_wait_ms
        self._tmp = tempfile.TemporaryDirectory(prefix="carpool-bench-")
        self.redis = EmbeddedRedis(Path(self._tmp.name) / "redis", is_persistent=False)
        self.port = free_port()
        self.metrics_port = free_port()
        self._runner: web.AppRunner | None = None
        self._worker: asyncio.subprocess.Process | None = None
        self._worker_log = Path(self._tmp.name) / "worker.log"
        self._log_file: BinaryIO | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> OnlineStack:
        self.redis.start()
        try:
            config = GatewayConfig(redis_url=self.redis.url, port=self.port, no_webhooks=True, api_keys=self.api_keys,
                                   max_lane_depth={"interactive": 100_000, "standard": 100_000, "batch": 100_000})
            self._runner = web.AppRunner(init_app(config))
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
            self._log_file = self._worker_log.open("wb")
            self._worker = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway.cli", "worker", "--redis-url", self.redis.url, "--model", self.model,
                "--batching", self.batching, "--max-num-seqs", str(self.max_num_seqs),
                "--max-wait-ms", str(self.max_wait_ms), "--metrics-host", "127.0.0.1",
                "--metrics-port", str(self.metrics_port), "--log-level", "WARNING",
                "--read-block-ms", str(self.read_block_ms), "--shutdown-grace-s", "5", "--device", self.device,
                *(["--dtype", self.dtype] if self.dtype else []),
                stdout=asyncio.subprocess.DEVNULL, stderr=self._log_file, env=self.child_env,
            )
            await self._wait_ready()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
        url = f"http://127.0.0.1:{self.metrics_port}/readyz"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while time.monotonic() < deadline:
                assert self._worker is not None
                if self._worker.returncode is not None:
                    tail = self._worker_log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"the benchmark worker exited with {self._worker.returncode}:\n{tail}")
                try:
                    async with session.get(url) as resp:
                        if resp.status == 200:
                            return
                except (aiohttp.ClientError, OSError, TimeoutError):
                    pass  # still loading the model
                await asyncio.sleep(0.2)
        raise RuntimeError(f"the benchmark worker was not ready after {WORKER_READY_TIMEOUT_S:g}s")

    async def preemptions(self) -> int | None:
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
                async with session.get(f"http://127.0.0.1:{self.metrics_port}/metrics") as resp:
                    text = await resp.text()
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None
        values = [float(v) for v in PREEMPTIONS_METRIC.findall(text)]
        return int(sum(values)) if values else 0

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self._worker is not None and self._worker.returncode is None:
                self._worker.terminate()
                try:
                    await asyncio.wait_for(self._worker.wait(), 15)
                except TimeoutError:
                    self._worker.kill()
                    await self._worker.wait()
            if self._runner is not None:
                await self._runner.cleanup()
        finally:
            if self._log_file is not None:
                self._log_file.close()
            self.redis.stop()
            self._tmp.cleanup()


async def _submit(session: aiohttp.ClientSession, base_url: str, body: dict[str, Any]) -> str:
    async with session.post(f"{base_url}/v1/jobs", json=body) as resp:
        if resp.status != 202:
            raise RuntimeError(f"submission refused with {resp.status}: {await resp.text()}")
        return str((await resp.json())["id"])


async def _read_replies(client: aioredis.Redis, stream: str, num_jobs: int,
                        on_token: Callable[[int], None] | None) -> list[dict[str, Any]]:
    """The final job records, as the worker XADDs them to the ``reply_to`` stream."""
    records: list[dict[str, Any]] = []
    last_id = "0-0"
    while len(records) < num_jobs:
        reply = await client.xread({stream: last_id}, block=1000, count=100)
        for _, entries in stream_entries(reply):
            for entry_id, fields in entries:
                last_id = entry_id.decode()
                assert fields is not None, "nothing deletes reply entries while the run reads them"
                record = msgpack.unpackb(fields[b"result"], raw=False, strict_map_key=False)
                records.append(record)
                if on_token is not None:
                    on_token(int((record.get("usage") or {}).get("completion_tokens") or 0))
    return records


async def run_online(stack: OnlineStack, workload: Workload, rate_label: str,
                     on_token: Callable[[int], None] | None = None) -> RunResult:
    """Submit ``workload`` at its arrival times and collect every result; times relative to the first submission.

    Results come back on a ``reply_to`` stream read by one task, as a
    producer that does not poll would take them.
    """
    requests = sorted(workload.requests, key=lambda r: r.arrival_s)
    stream = f"bench:replies:{uuid.uuid4().hex}"
    client = aioredis.Redis.from_url(stack.redis.url)
    connector = aiohttp.TCPConnector(limit=SUBMIT_CONNECTIONS)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
            preempted_before = await stack.preemptions()
            reader = asyncio.create_task(_read_replies(client, stream, len(requests), on_token))
            submissions: list[asyncio.Task[str]] = []
            try:
                start_mono = time.monotonic()
                start_unix = time.time()
                for r in requests:
                    delay = r.arrival_s - (time.monotonic() - start_mono)
                    if delay > 0:
                        await asyncio.sleep(delay)
                    body = {"prompt_token_ids": r.prompt_token_ids, "lane": r.lane, "priority": r.priority,
                            "reply_to": stream, "params": {"max_tokens": r.max_tokens, "ignore_eos": True,
                                                                 "temperature": r.temperature}}
                    submissions.append(asyncio.create_task(_submit(session, stack.base_url, body)))
                await asyncio.gather(*submissions)
                records = await asyncio.wait_for(reader, RESULTS_TIMEOUT_S)
            finally:
                for task in (reader, *submissions):
                    task.cancel()
            preempted_after = await stack.preemptions()
    finally:
        await client.aclose()
    timings = [_timing(rec, start_unix) for rec in records]
    end = max((t.finished_s or 0.0) for t in timings)
    preemptions = 0 if preempted_before is None or preempted_after is None else preempted_after - preempted_before
    return RunResult(
        workload=workload.name, mode="online", system=stack.batching, duration_s=end,
        requests=timings, max_num_seqs=stack.max_num_seqs, timeline=_timeline(timings),
        num_preemptions=preemptions,
        extra={"rate": rate_label, "failed": sum(rec["status"] != "succeeded" for rec in records)},
    )
def _timing(record: dict[str, Any], start_unix: float) -> RequestTiming:
    created = record["created_at"] - start_unix
    timings = record["timings"]
    n = int((record.get("usage") or {}).get("completion_tokens") or 0)
    timing = RequestTiming(lane=record.get("lane") or "standard", arrival_s=created, num_output_tokens=n)
    if timings.get("queued_s") is not None:
        timing.admitted_s = created + timings["queued_s"]
    if timings.get("ttft_s") is not None:
        timing.first_token_s = created + timings["ttft_s"]
    if record["status"] == "succeeded" and timings.get("e2e_s") is not None:
        timing.finished_s = created + timings["e2e_s"]
    if timing.first_token_s is not None and timing.finished_s is not None and n > 1:
        timing.token_gaps_s = [(timing.finished_s - timing.first_token_s) / (n - 1)] * (n - 1)
    return timing


def _timeline(timings: list[RequestTiming], num_points: int = 200) -> list[Sample]:
    """Jobs running and queued over time, rebuilt from the records (no KV view from outside the worker)."""
    end = max((t.finished_s or 0.0) for t in timings)
    samples = []
    for i in range(num_points + 1):
        t = end * i / num_points
        running = sum(1 for r in timings if r.admitted_s is not None and r.admitted_s <= t < (r.finished_s or end))
        queued = sum(1 for r in timings if r.arrival_s <= t and (r.admitted_s is None or t < r.admitted_s))
        samples.append(Sample(t, running, 0, queued, None))
    return samples
