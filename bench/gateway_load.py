"""How many concurrent requests one gateway process holds: POSTs, long-polls and event streams.

    python -m bench.gateway_load --posts 1000 --waiters 2000

Starts a real redis-server and a real gateway process (no worker: the script
finishes the jobs itself, as a worker would, once every waiter is open), then
runs three phases, each all at once: ``--posts`` concurrent ``POST /v1/jobs``
(twice, so there are enough jobs for the waiters), ``--waiters`` concurrent
``GET /v1/jobs/{id}?wait=…`` long-polls on distinct jobs, and ``--waiters``
concurrent event streams. Prints a table of the answers each phase got; the
claim is that none of them is a 5xx.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import redis.asyncio as aioredis

from gateway.cli.embedded_redis import EmbeddedRedis, free_port
from scheduler.protocol.job_record import final_event, job_view
from scheduler.protocol.keys import Keys
from scheduler.protocol.redis_replies import read_hash

KEYS = Keys()
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Phase:
    name: str
    concurrency: int
    statuses: Counter[int]
    seconds: float

    @property
    def num_5xx(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--posts", type=int, default=1000, help="concurrent POST /v1/jobs")
    parser.add_argument("--waiters", type=int, default=2000, help="concurrent long-polls, then concurrent event streams")
    parser.add_argument("--gateway-flag", action="append", default=[], help="extra flag for the gateway (repeatable)")
    return parser.parse_args(argv)


async def _post(http: aiohttp.ClientSession, url: str, i: int) -> tuple[int, str]:
    try:
        async with http.post(f"{url}/v1/jobs", json={"prompt": f"load {i}", "params": {"max_tokens": 4}}) as resp:
            body = await resp.json(content_type=None)
            return resp.status, body.get("id", "") if isinstance(body, dict) else ""
    except (aiohttp.ClientError, ValueError):
        return 0, ""  # 0: no HTTP answer at all


async def _long_poll(http: aiohttp.ClientSession, url: str, job_id: str) -> int:
    try:
        async with http.get(f"{url}/v1/jobs/{job_id}?wait=60") as resp:
            body = await resp.json(content_type=None)
            return resp.status if body.get("status") == "succeeded" or resp.status != 200 else -1
    except (aiohttp.ClientError, ValueError):
        return 0


async def _stream(http: aiohttp.ClientSession, url: str, job_id: str) -> int:
    try:
        async with http.get(f"{url}/v1/jobs/{job_id}/events") as resp:
            if resp.status != 200:
                return resp.status
            async for line in resp.content:
                if line.startswith(b"event: final"):
                    return 200
            return -1  # -1: a 200 that ended without the final event
    except aiohttp.ClientError:
        return 0


async def _open_waiters(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(f"{url}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith("carpool_gateway_open_waiters"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _finish(redis: aioredis.Redis, ids: list[str]) -> None:
    """Write every job's result and publish its final event, as a worker does."""
    now = time.time()
    output = msgpack.packb({"text": "ok", "token_ids": [1], "finish_reason": "length"})
    for start in range(0, len(ids), 500):
        chunk = ids[start:start + 500]
        async with redis.pipeline(transaction=False) as pipe:
            for job_id in chunk:
                pipe.hset(KEYS.job(job_id), mapping={"status": "succeeded", "started_at": repr(now),
                                                     "finished_at": repr(now), "worker": "bench", "output": output})
            await pipe.execute()
        async with redis.pipeline(transaction=False) as pipe:
            for job_id in chunk:
                view = job_view(await read_hash(redis, KEYS.job(job_id)))
                pipe.publish(KEYS.events(job_id), msgpack.packb(final_event(job_id, view, view["attempts"])))
            await pipe.execute()


async def _waiters(name: str, http: aiohttp.ClientSession, redis: aioredis.Redis, url: str, ids: list[str],
                   wait: Callable[[aiohttp.ClientSession, str, str], Coroutine[Any, Any, int]]) -> Phase:
    started = time.perf_counter()
    tasks = [asyncio.create_task(wait(http, url, job_id)) for job_id in ids]
    deadline = time.monotonic() + 120
    while await _open_waiters(http, url) < len(ids) and time.monotonic() < deadline:
        if all(t.done() for t in tasks):
            break
        await asyncio.sleep(0.5)
    await _finish(redis, ids)
    statuses = Counter(await asyncio.gather(*tasks))
    return Phase(name, len(ids), statuses, time.perf_counter() - started)


async def run(args: argparse.Namespace, redis_url: str, url: str) -> list[Phase]:
    phases = []
    redis = aioredis.Redis.from_url(redis_url)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as http:
        ids: list[str] = []
        while len(ids) < args.waiters:
            started = time.perf_counter()
            posted = await asyncio.gather(*(_post(http, url, len(ids) + i) for i in range(args.posts)))
            phases.append(Phase("POST /v1/jobs", args.posts, Counter(s for s, _ in posted), time.perf_counter() - started))
            ids += [job_id for status, job_id in posted if status == 202]
        ids = ids[:args.waiters]
        phases.append(await _waiters("GET /v1/jobs/{id}?wait=60", http, redis, url, ids, _long_poll))
        await redis.delete(*(KEYS.job(i) for i in ids))
        await redis.delete(*(KEYS.lane(lane) for lane in ("interactive", "standard", "batch")))
        posted = await asyncio.gather(*(_post(http, url, i) for i in range(args.waiters)))
        ids = [job_id for status, job_id in posted if status == 202]
        phases.append(await _waiters("GET /v1/jobs/{id}/events", http, redis, url, ids, _stream))
    await redis.aclose()
    return phases


def print_table(phases: list[Phase], command: str) -> None:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    print(f"machine: {cpu}, {os.cpu_count()} CPU cores; {platform.system()} {platform.release()}; Python {platform.python_version()}")
    print(f"command: {command}")
    print("| phase | concurrent | answers | 5xx | seconds |")
    print("|---|---|---|---|---|")
    for p in phases:
        answers = ", ".join(f"{n} × {status}" for status, n in sorted(p.statuses.items()))
        print(f"| `{p.name}` | {p.concurrency} | {answers} | {p.num_5xx} | {p.seconds:.1f} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4 * (args.waiters + args.posts) + 1024
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard))
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp), is_persistent=False) as server:
        port = free_port()
        log_path = Path(tmp) / "gateway.log"
        with open(log_path, "wb") as log:
            gateway = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "gateway", "--redis-url", server.url, "--port", str(port),
                 "--no-webhooks", "--log-level", "WARNING", *args.gateway_flag],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(300):
                try:
                    urllib.request.urlopen(f"{url}/healthz", timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.1)
            phases = asyncio.run(run(args, server.url, url))
        finally:
            gateway.terminate()
            gateway.wait(timeout=30)
        print_table(phases, "python -m bench.gateway_load " + " ".join(argv if argv is not None else sys.argv[1:]))
        errors = [line for line in log_path.read_text(errors="replace").splitlines() if '"level": "error"' in line]
        print(f"gateway log: {len(errors)} error lines")
    return 1 if any(p.num_5xx for p in phases) or errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
