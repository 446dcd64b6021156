"""Redis unreachable or out of memory while jobs are in flight: workers wait it out or stop cleanly, and every
job still ends exactly once."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import urllib.error
import urllib.request

import msgpack
import pytest
import redis.asyncio as aioredis

from gateway.cli.embedded_redis import EmbeddedRedis
from scheduler.params import SamplingParams
from scheduler.protocol.job import JobSpec
from scheduler.protocol.lanes import Lane
from tests.harness.redis_proxy import RedisProxy
from tests.harness.worker_harness import (KEYS, running_worker, start_worker_process, wait_terminal, wait_until,
                                         xadd_job)

HELD_TOKENS = 1500
"""Most of the tiny model's context (2048): far more steps than pass while a test acts on a running job."""


@pytest.fixture
def engine(tiny_model):
    from worker.engine.engine import Engine

    return Engine(model=tiny_model(), max_num_seqs=4)


async def replies(client: aioredis.Redis, stream: str) -> list[str]:
    """The job ids of the entries on a reply stream, in order."""
    return [msgpack.unpackb(fields[b"result"], raw=False)["id"] for _, fields in await client.xrange(stream)]


async def test_a_worker_stopped_while_redis_is_unreachable_exits_and_its_job_ends_once(redis_url, tiny_model, tmp_path):
    """SIGTERM with Redis gone: the checkpoints and the hand-back cannot be written, so the worker gives them up
    and exits like a crashed one (its engine process with it); its job is reclaimed after the lease."""
    client = aioredis.Redis.from_url(redis_url)
    proxy = await RedisProxy(redis_url).start()
    model = tiny_model()
    params = SamplingParams(max_tokens=HELD_TOKENS, temperature=0, ignore_eos=True)
    await xadd_job(client, JobSpec(id="stranded", prompt="stopped in an outage", params=params,
                                   reply_to="replies:outage"))
    stopped = start_worker_process(proxy.url, model, "stopped", tmp_path / "stopped.log", "--shutdown-grace-s", "0")
    taker = None
    try:
        await wait_until(lambda: client.hget(KEYS.job("stranded"), "checkpoint"), "the job's first checkpoint")
        proxy.go_down()
        stopped.send_signal(signal.SIGTERM)
        await wait_until(lambda: stopped.poll() is not None, "the worker's exit with Redis unreachable")
        assert stopped.returncode == 1  # its jobs were not handed back
        proxy.restore()
        taker = start_worker_process(redis_url, model, "taker", tmp_path / "taker.log")
        views = await wait_terminal(client, ["stranded"])
    finally:
        for proc in (stopped, taker):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        await proxy.aclose()
    view = views["stranded"]
    assert view["status"] == "succeeded"
    assert view["worker"] == "taker"
    assert len(view["output"]["token_ids"]) == HELD_TOKENS
    assert await replies(client, "replies:outage") == ["stranded"]
    await client.aclose()


async def test_a_commit_that_meets_an_outage_is_written_once_redis_is_back(redis_url, engine):
    """Redis goes away just as a job ends: its commit is written when Redis is back, by the worker that ran it,
    rather than the job running again from its last checkpoint after the lease."""
    client = aioredis.Redis.from_url(redis_url)
    proxy = await RedisProxy(redis_url).start()
    # Only the commit carries both the job's event channel and its lane stream.
    proxy.refuse(KEYS.events("ending").encode(), KEYS.lane(Lane.STANDARD).encode(), then_down=True)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    try:
        async with running_worker(proxy.url, engine, lease_s=10.0) as service:
            await xadd_job(client, JobSpec(id="ending", prompt="ends in an outage", params=params,
                                           reply_to="replies:ending"))
            await wait_until(lambda: proxy.num_refused == 1, "the job's commit meeting the outage")
            proxy.restore()
            views = await wait_terminal(client, ["ending"])
            assert not service.has_failed
    finally:
        await proxy.aclose()
    view = views["ending"]
    assert view["status"] == "succeeded"
    assert (view["attempts"], view["resumed_from"]) == (1, 0)  # run once, never reclaimed
    assert len(view["output"]["token_ids"]) == 40
    assert await replies(client, "replies:ending") == ["ending"]
    await client.aclose()


async def beats_since(client: aioredis.Redis, worker: str, since: float) -> bool:
    raw = await client.hget(KEYS.workers, worker)
    return raw is not None and msgpack.unpackb(raw, raw=False)["time"] > since


async def test_a_worker_waits_out_redis_at_maxmemory_and_its_jobs_end_once(engine, tmp_path):
    """At maxmemory (``noeviction``) Redis refuses the heartbeat, the checkpoints and the commits: the worker keeps
    going, and once memory is freed the running job and a new one end once each."""
    server = EmbeddedRedis(tmp_path / "redis", is_persistent=False).start()
    client = aioredis.Redis.from_url(server.url)
    params = SamplingParams(max_tokens=HELD_TOKENS, temperature=0, ignore_eos=True)
    try:
        async with running_worker(server.url, engine, heartbeat_interval_s=0.05) as service:
            await xadd_job(client, JobSpec(id="across", prompt="runs across a full Redis", params=params,
                                           reply_to="replies:full"))
            await wait_until(lambda: client.hget(KEYS.job("across"), "checkpoint"), "the job's first checkpoint")
            from aiohttp.test_utils import TestClient, TestServer

            async with TestClient(TestServer(service.http_app())) as probe:
                await client.config_set("maxmemory", 1)
                # (Writable since its first heartbeat: only a heartbeat refused at maxmemory turns it off.)
                await wait_until(lambda: not service.is_redis_writable, "a heartbeat refused at maxmemory")
                ready = await probe.get("/readyz")
                assert ready.status == 503 and (await ready.json())["redis"] == "unavailable"
                await client.config_set("maxmemory", 0)
                await wait_until(lambda: service.is_redis_writable, "a heartbeat written again")
                assert (await probe.get("/readyz")).status == 200
            freed_at = time.time()
            await xadd_job(client, JobSpec(id="after", prompt="queued once memory is back", params=params,
                                           reply_to="replies:full"))
            views = await wait_terminal(client, ["across", "after"])
            assert not service.stopped.is_set() and not service.has_failed
            await wait_until(lambda: beats_since(client, service.config.worker_name, freed_at),
                             "a heartbeat once memory is freed")
        assert sorted(await replies(client, "replies:full")) == ["across", "after"]
    finally:
        await client.aclose()
        server.stop()
    for view in views.values():
        assert view["status"] == "succeeded"
        assert len(view["output"]["token_ids"]) == HELD_TOKENS


async def test_an_entry_read_just_before_an_outage_is_admitted_once_redis_is_back(redis_url, engine):
    """The worker reads an entry, then Redis goes away before its job can start: that delivery is no fault of
    the job, so the worker keeps the entry and starts the job when Redis is back, instead of leaving it to be
    redelivered and counted against max_deliveries."""
    client = aioredis.Redis.from_url(redis_url)
    proxy = await RedisProxy(redis_url).start()
    # Only the job's start carries both its record and its cancel flag before it runs.
    proxy.refuse(KEYS.job("unlucky").encode(), KEYS.cancel("unlucky").encode(), then_down=True)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    try:
        # A single delivery allowed: one counted redelivery would fail the job.
        async with running_worker(proxy.url, engine, max_deliveries=1, lease_s=1.0) as service:
            await xadd_job(client, JobSpec(id="unlucky", prompt="read just before an outage", params=params,
                                           reply_to="replies:unlucky"))
            await wait_until(lambda: proxy.num_refused == 1, "the job's start meeting the outage")
            proxy.restore()
            views = await wait_terminal(client, ["unlucky"])
            assert not service.has_failed
    finally:
        await proxy.aclose()
    view = views["unlucky"]
    assert view["status"] == "succeeded"
    assert len(view["output"]["token_ids"]) == 8
    assert await replies(client, "replies:unlucky") == ["unlucky"]
    assert await client.xlen(KEYS.dead) == 0
    await client.aclose()


async def test_an_outage_longer_than_the_lease_moves_no_job_between_live_workers(redis_url, tiny_model, caplog):
    """Every lease lapses while Redis is away, live workers' too: once it is back, a worker with free slots must
    not reclaim the jobs another live worker is still running (each would count a delivery, and run again from
    its checkpoint). Both workers say the outage of their steps' writes once (or once more), not once a step."""
    from worker.engine.engine import Engine

    client = aioredis.Redis.from_url(redis_url)
    proxy = await RedisProxy(redis_url).start()
    model = tiny_model()
    params = SamplingParams(max_tokens=HELD_TOKENS, temperature=0, ignore_eos=True)
    ids = [f"held-{i}" for i in range(4)]
    lease_s = 1.0
    try:
        # Two slots: the first worker runs two jobs and leaves two in the lane for the second, which keeps two
        # slots free to reclaim with.
        async with running_worker(proxy.url, Engine(model=model, max_num_seqs=2), lease_s=lease_s,
                                  worker_name="first") as first:
            for job_id in ids:
                await xadd_job(client, JobSpec(id=job_id, prompt=f"{job_id} runs across an outage", params=params))
            async with running_worker(proxy.url, Engine(model=model, max_num_seqs=4), lease_s=lease_s,
                                      worker_name="second") as second:
                for job_id in ids:
                    await wait_until(lambda job_id=job_id: client.hget(KEYS.job(job_id), "checkpoint"),
                                     f"{job_id}'s first checkpoint")
                with caplog.at_level(logging.INFO):
                    proxy.go_down()
                    await asyncio.sleep(3 * lease_s)
                    proxy.restore()
                    views = await wait_terminal(client, ids)
                assert not first.has_failed and not second.has_failed
    finally:
        await proxy.aclose()
        await client.aclose()
    owners = {job_id: view["worker"] for job_id, view in views.items()}
    assert sorted(owners.values()) == ["first", "first", "second", "second"], owners
    for view in views.values():
        assert view["status"] == "succeeded"
        assert (view["attempts"], view["resumed_from"]) == (1, 0), view
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "reclaimed" in m], messages
    # Once a worker, not once a step (a step takes milliseconds, the outage 3 s). A pooled connection the outage
    # severed can fail one write after the first success, which is a short outage of its own: said again, once.
    for name in ("first", "second"):
        said = [m for m in messages if m.startswith(f"worker {name} step writes (") and "Redis unavailable" in m]
        assert 1 <= len(said) <= 2, messages
    assert not [m for m in messages if "of this step not written" in m]


async def test_an_admission_waiting_out_maxmemory_holds_up_no_other_entry(engine, tmp_path):
    """A large entry whose start Redis refuses at maxmemory (its record would not fit) waits for memory in its own
    slot; the worker goes on reading, and a small interactive job that fits is admitted meanwhile."""
    server = EmbeddedRedis(tmp_path / "redis", is_persistent=False).start()
    client = aioredis.Redis.from_url(server.url)
    params = SamplingParams(max_tokens=2, temperature=0)
    try:
        used = int((await client.info("memory"))["used_memory"])
        producer = aioredis.Redis.from_url(server.url)  # closed after: its 2 MB read buffer in Redis goes with it
        await xadd_job(producer, JobSpec(id="large", prompt="a large job", params=params,
                                         metadata={"blob": "x" * 2_000_000}))
        await producer.aclose()
        # Room for the large entry and small jobs, not for the large job's record beside it.
        await client.config_set("maxmemory", used + 3_000_000)
        async with running_worker(server.url, engine) as service:
            await wait_until(lambda: service.intake.admitting, "the large entry's admission under way")

            async def small_enqueued() -> bool:
                try:  # refused while a try of the large start holds its 2 MB in Redis
                    await xadd_job(client, JobSpec(id="small", prompt="a small job", params=params,
                                                   lane=Lane.INTERACTIVE))
                except aioredis.OutOfMemoryError:
                    return False
                return True

            await wait_until(small_enqueued, "the small job enqueued")
            # Admitted (its writes may meet the tries of the large start, so it need not end before memory is freed).
            await wait_until(lambda: client.hget(KEYS.job("small"), "status"), "the small job admitted",
                             timeout_s=60)
            assert await client.hget(KEYS.job("large"), "status") is None  # still waiting for memory
            await client.config_set("maxmemory", 0)
            views = await wait_terminal(client, ["small", "large"])
            assert not service.stopped.is_set()
        assert views["small"]["status"] == views["large"]["status"] == "succeeded"
        assert views["large"]["metadata"]["blob"] == "x" * 2_000_000
    finally:
        await client.aclose()
        server.stop()


async def test_a_write_refused_at_maxmemory_is_tried_ever_less_often_and_an_unreachable_redis_every_half_second(
        tmp_path) -> None:
    """Each try of a refused write holds its arguments in Redis while Redis refuses them: refused at maxmemory,
    the tries back off (0.5, 1, 2, then every 4 s), and a Redis that cannot be reached, whose tries cost it
    nothing, is tried every 0.5 s again."""
    from gateway.cli.embedded_redis import free_port
    from worker.redis_errors import REDIS_DOWN, RetryDelay, is_redis_down

    server = EmbeddedRedis(tmp_path / "redis", is_persistent=False).start()
    client = aioredis.Redis.from_url(server.url)
    gone = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0")
    try:
        await client.config_set("maxmemory", 1)
        with pytest.raises(aioredis.OutOfMemoryError) as refused:
            await client.set("x", "y" * 1000)
        with pytest.raises(REDIS_DOWN) as unreachable:
            await gone.ping()
    finally:
        await gone.aclose()
        await client.aclose()
        server.stop()
    assert is_redis_down(refused.value) and is_redis_down(unreachable.value)
    delay = RetryDelay()
    assert [delay.after(refused.value) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert delay.after(unreachable.value) == 0.5
    assert delay.after(refused.value) == 0.5  # a new run of refusals starts over


def test_a_worker_started_before_its_redis_waits_for_it_then_serves(tiny_model, tmp_path):
    """A cluster coming up in any order: the worker says it waits (no traceback), answers its health checks
    meanwhile (alive, not ready: a startup probe does not count the outage), and takes jobs once Redis is up; a
    signal while it waits ends it at once, cleanly."""
    from gateway.cli.embedded_redis import free_port

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    metrics_port = free_port()
    early = start_worker_process(url, tiny_model(), "early", tmp_path / "early.log", "--metrics-port",
                                 str(metrics_port))
    waiting = start_worker_process(f"redis://127.0.0.1:{free_port()}/0", tiny_model(), "stopped-waiting",
                                   tmp_path / "stopped.log")
    server = None
    try:
        for log in ("early.log", "stopped.log"):
            wait_until_text(tmp_path / log, "the worker waits for it before reading any job")
        assert _http_status(metrics_port, "/healthz") == 200
        assert _http_status(metrics_port, "/readyz") == 503
        waiting.send_signal(signal.SIGTERM)
        assert waiting.wait(timeout=60) == 0
        server = EmbeddedRedis(tmp_path / "redis", port=port, is_persistent=False).start()

        async def run_one() -> dict:
            client = aioredis.Redis.from_url(url)
            try:
                await xadd_job(client, JobSpec(id="after-redis", prompt="x", params=SamplingParams(max_tokens=2)))
                return (await wait_terminal(client, ["after-redis"]))["after-redis"]
            finally:
                await client.aclose()

        assert asyncio.run(run_one())["status"] == "succeeded"
        assert _http_status(metrics_port, "/readyz") == 200
    finally:
        for proc in (early, waiting):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if server is not None:
            server.stop()
    for log in ("early.log", "stopped.log"):
        assert "Traceback" not in (tmp_path / log).read_text()


def test_a_signal_while_the_model_loads_stops_the_worker_before_it_takes_a_job(redis_url, tiny_model, tmp_path):
    """A pod deleted while its worker loads the model: the signal is not lost (as PID 1, a process without a
    handler would not see it), the engine's start is cut short, and the worker exits 0 having taken nothing."""
    worker = start_worker_process(redis_url, tiny_model(), "loading", tmp_path / "loading.log")
    try:
        wait_until_text(tmp_path / "loading.log", "loading model")
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0, (tmp_path / "loading.log").read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.wait()
    said = (tmp_path / "loading.log").read_text()
    assert "stopped while the model loaded: no job was taken" in said and "Traceback" not in said, said
    assert "ready (capacity" not in said

    async def heartbeat() -> bool:
        client = aioredis.Redis.from_url(redis_url)
        try:
            return bool(await client.hexists(KEYS.workers, "loading"))
        finally:
            await client.aclose()

    assert not asyncio.run(heartbeat())


def _http_status(port: int, path: str) -> int:
    """The status of a GET of the worker's health server."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def wait_until_text(path, text: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, f"{path.name} never said {text!r}: {path.read_text()[-2000:]}"
        time.sleep(0.1)
