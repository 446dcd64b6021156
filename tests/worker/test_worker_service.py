"""The worker against a real redis-server and a real tiny model: results, replies, poison, expiry, cancel, leases."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import redis.asyncio as aioredis

from scheduler.params import SamplingParams
from scheduler.protocol.job import JobSpec
from scheduler.protocol.keys import CONSUMER_GROUP
from scheduler.protocol.lanes import LANES, Lane
from tests.harness.worker_harness import KEYS, WAIT_S, has_status, running_worker, status_of, wait_terminal, wait_until, xadd_job

LONG_CONTEXT = 16384
LONG_TOKENS = 16000
"""A job this long runs for many seconds on any CPU; tests that need a job still running use it, and end it early."""


@pytest.fixture
def engine_factory(tiny_model):
    from worker.engine.engine import Engine

    def make(**kwargs):
        kwargs.setdefault("max_num_seqs", 16)
        kwargs.setdefault("policy", "priority")
        kwargs.setdefault("model", tiny_model())
        return Engine(**kwargs)

    return make


async def test_a_ready_worker_has_its_heartbeat_in_redis(redis_url, engine_factory):
    """A gateway asked right after a worker is ready (its /v1/models, /readyz) must already know it."""
    client = aioredis.Redis.from_url(redis_url)
    async with running_worker(redis_url, engine_factory(), worker_name="w-ready") as service:
        assert service.is_ready
        beat = msgpack.unpackb(await client.hget(KEYS.workers, "w-ready"))
        assert beat["capacity"] == service.config.capacity and beat["max_model_len"] > 0
        assert beat["vocab_size"] == service.engine.vocab_size > 0 and beat["started"] <= beat["time"]
    assert not await client.hexists(KEYS.workers, "w-ready")  # a clean stop removes it
    # The model it served stays known after it stops (requests for it may wait for the next worker).
    assert float(await client.hget(KEYS.models, service.config.model_name)) == beat["time"]
    await client.aclose()


async def test_a_worker_joining_workers_of_another_model_says_so(redis_url, engine_factory, caplog):
    """They would share the lanes, each running the other's jobs: the operator is told to split the prefixes."""
    client = aioredis.Redis.from_url(redis_url)
    await client.hset(KEYS.workers, "w-other", msgpack.packb({"time": time.time(), "model": "other-model"}))
    await client.hset(KEYS.workers, "w-gone", msgpack.packb({"time": time.time() - 3600, "model": "gone-model"}))
    with caplog.at_level("WARNING", logger="worker.service"):
        async with running_worker(redis_url, engine_factory(), worker_name="w-new", served_model_name="mine"):
            pass
    await client.aclose()
    (warning,) = [r.getMessage() for r in caplog.records if "share its lanes" in r.getMessage()]
    assert "'mine'" in warning and "['other-model']" in warning and "--key-prefix" in warning
    assert not [r for r in caplog.records if "--lease-s" in r.getMessage()]  # heartbeats that name no lease


async def test_a_worker_joining_workers_on_another_lease_says_so(redis_url, engine_factory, caplog):
    """The shorter lease's worker would take the other's running jobs as lost (it reclaims entries idle for its
    own lease; the other renews every third of its own) and run them again."""
    client = aioredis.Redis.from_url(redis_url)
    model = "tiny"
    await client.hset(KEYS.workers, "w-long", msgpack.packb({"time": time.time(), "model": model, "lease_s": 30.0}))
    await client.hset(KEYS.workers, "w-same", msgpack.packb({"time": time.time(), "model": model, "lease_s": 6.0}))
    # Its own last run's beat, on another lease, under the name it starts with again: not another worker.
    await client.hset(KEYS.workers, "w-new", msgpack.packb({"time": time.time(), "model": model, "lease_s": 2.0}))
    with caplog.at_level("WARNING", logger="worker.service"):
        async with running_worker(redis_url, engine_factory(), worker_name="w-new", served_model_name=model,
                                  lease_s=6.0):
            beat = msgpack.unpackb(await client.hget(KEYS.workers, "w-new"))
    await client.aclose()
    assert beat["lease_s"] == 6.0
    (warning,) = [r.getMessage() for r in caplog.records if "--lease-s" in r.getMessage()]
    assert "6s lease" in warning and "on 30s:" in warning, warning
    assert not [r for r in caplog.records if "share its lanes" in r.getMessage()]


async def test_jobs_over_three_lanes_match_offline_engine(redis_url, engine_factory):
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    specs = [
        JobSpec(id=f"job-{i}", prompt=f"lane test prompt {i} " + "x" * (i % 5), params=greedy,
                lane=LANES[i % 3], reply_to=("replies:a" if i % 4 == 0 else "replies:b" if i % 4 == 1 else None))
        for i in range(40)
    ]
    expected = engine_factory().generate([s.prompt for s in specs], greedy)
    client = aioredis.Redis.from_url(redis_url)
    async with running_worker(redis_url, engine_factory()):
        for spec in specs:
            await xadd_job(client, spec)
        views = await wait_terminal(client, [s.id for s in specs])
    for spec, completion in zip(specs, expected):
        view = views[spec.id]
        assert view["status"] == "succeeded", view
        assert view["output"]["token_ids"] == completion.token_ids
        assert view["output"]["text"] == completion.text
        assert view["attempts"] == 1
        assert view["lane"] == spec.lane.value
        timings = view["timings"]
        assert timings["queued_s"] >= 0 and timings["ttft_s"] >= timings["queued_s"]
        assert timings["e2e_s"] >= timings["ttft_s"]
        assert view["usage"]["completion_tokens"] == len(completion.token_ids)
    for stream, wanted in (("replies:a", {s.id for s in specs if s.reply_to == "replies:a"}),
                           ("replies:b", {s.id for s in specs if s.reply_to == "replies:b"})):
        entries = await client.xrange(stream)
        got = [msgpack.unpackb(fields[b"result"], raw=False)["id"] for _, fields in entries]
        assert sorted(got) == sorted(wanted)  # exactly one reply per job
    for lane in Lane:  # acknowledged and deleted: nothing pending, nothing left in the lanes
        assert await client.xlen(KEYS.lane(lane)) == 0
        assert (await client.xpending(KEYS.lane(lane), CONSUMER_GROUP))["pending"] == 0
    await client.aclose()


async def test_poison_entries_are_dead_lettered_and_the_worker_keeps_serving(redis_url, engine_factory):
    client = aioredis.Redis.from_url(redis_url)
    lane = KEYS.lane(Lane.STANDARD)
    async with running_worker(redis_url, engine_factory()):
        await client.xadd(lane, {"job": b"\xc1\xff not msgpack"})
        await client.xadd(lane, {"something": b"else"})
        await client.xadd(lane, {"job": msgpack.packb({"v": 1, "id": "no-prompt"})})
        await client.xadd(lane, {"job": msgpack.packb({"v": 1, "id": "bad-params", "prompt": "hi",
                                                       "params": {"temperature": -1}})})
        await client.xadd(lane, {"job": b"hello, not a job"})  # neither JSON nor msgpack
        await client.xadd(lane, {"job": msgpack.packb(5)})  # msgpack, but not a map
        await client.xadd(lane, {"job": '{"v": 1, "id": "bad-stop", "prompt": "hi", "params": {"stop": 5}}'})
        good = JobSpec(id="good", prompt="still serving", params=SamplingParams(max_tokens=3, temperature=0))
        await xadd_job(client, good)
        views = await wait_terminal(client, ["no-prompt", "bad-params", "bad-stop", "good"])
        await wait_until(lambda: has_dead(client, 7), "7 dead-lettered entries")
    assert views["good"]["status"] == "succeeded"
    assert views["no-prompt"]["status"] == "failed"
    assert views["no-prompt"]["error"]["field"] == "prompt"
    assert views["bad-params"]["status"] == "failed"
    assert views["bad-params"]["error"]["field"] == "params.temperature"
    assert "temperature" in views["bad-params"]["error"]["message"]
    assert views["bad-stop"]["status"] == "failed"
    assert views["bad-stop"]["error"]["field"] == "params.stop"
    assert views["bad-stop"]["error"]["message"] == "params.stop: must be a string or a list of strings, got integer"
    dead = await client.xrange(KEYS.dead)
    reasons = sorted(fields[b"reason"].decode() for _, fields in dead)
    assert len(dead) == 7
    assert sum("job: must be a msgpack map or a JSON object; it is" in r for r in reasons) == 3, reasons
    assert "invalid job: params.stop: must be a string or a list of strings, got integer" in reasons
    assert any("no 'job' field" in r for r in reasons)
    assert (await client.xpending(lane, CONSUMER_GROUP))["pending"] == 0
    await client.aclose()


async def has_dead(client: aioredis.Redis, count: int) -> bool:
    return await client.xlen(KEYS.dead) >= count


async def test_expired_job_never_runs(redis_url, engine_factory):
    client = aioredis.Redis.from_url(redis_url)
    engine = engine_factory()
    spec = JobSpec(id="late", prompt="too late", deadline=time.time() - 1, reply_to="replies:late",
                   params=SamplingParams(max_tokens=4))
    async with running_worker(redis_url, engine):
        await xadd_job(client, spec)
        views = await wait_terminal(client, ["late"])
    view = views["late"]
    assert view["status"] == "expired"
    assert view["started_at"] is None and view["output"] is None
    assert view["error"]["type"] == "expired"
    assert engine.stats().num_steps == 0  # the engine never saw it
    assert len(await client.xrange("replies:late")) == 1
    await client.aclose()


async def test_cancel_running_job_frees_its_blocks(redis_url, engine_factory, tiny_model):
    client = aioredis.Redis.from_url(redis_url)
    # A context so long that the job cannot end before the cancel reaches it, at any engine speed.
    engine = engine_factory(enable_prefix_caching=False, model=tiny_model(max_position_embeddings=LONG_CONTEXT))
    spec = JobSpec(id="long", prompt="a long one", params=SamplingParams(max_tokens=LONG_TOKENS, ignore_eos=True))
    async with running_worker(redis_url, engine, checkpoint_tokens=2) as service:
        await xadd_job(client, spec)
        await wait_until(lambda: client.hget(KEYS.job("long"), "checkpoint"), "the job's first checkpoint")
        assert engine.stats().num_kv_blocks_used > 0
        # What the gateway does for a running job: raise the flag, tell the workers.
        await client.set(KEYS.cancel("long"), "1")
        await client.publish(KEYS.control, msgpack.packb({"type": "cancel", "id": "long"}))
        views = await wait_terminal(client, ["long"])
        await wait_until(lambda: not engine.stats().num_kv_blocks_used, "the job's blocks freed")
        stats = engine.stats()
    assert views["long"]["status"] == "cancelled"
    assert views["long"]["usage"]["completion_tokens"] < LONG_TOKENS
    assert stats.num_kv_blocks_used == 0 and stats.num_running == 0
    await client.aclose()


async def test_live_worker_keeps_its_lease_beyond_the_lease_time(redis_url, tiny_model):
    """A job running for several lease periods on a live worker is never handed to the other worker."""
    from worker.engine.engine import Engine

    lease_s = 1.0
    # A context long enough that the job cannot finish within the observation window, however fast the CPU.
    model = tiny_model(max_position_embeddings=LONG_CONTEXT)
    spec = JobSpec(id="slow", prompt="slow job", params=SamplingParams(max_tokens=LONG_TOKENS, ignore_eos=True,
                                                                       temperature=0))
    client = aioredis.Redis.from_url(redis_url)
    finals: list[bytes] = []
    pubsub = client.pubsub()
    await pubsub.subscribe(KEYS.events("slow"))

    async def listen():
        async for message in pubsub.listen():
            if message["type"] != "message":
                continue
            kind = msgpack.unpackb(message["data"])["type"]
            if kind == "end":
                return
            if kind == "final":
                finals.append(message["data"])

    listener = asyncio.create_task(listen())
    async with running_worker(redis_url, Engine(model=model, max_num_seqs=4), lease_s=lease_s, worker_name="a"):
        async with running_worker(redis_url, Engine(model=model, max_num_seqs=4), lease_s=lease_s, worker_name="b"):
            await xadd_job(client, spec)
            await wait_until(lambda: has_status(client, "slow", "running"), "the job running")
            owner = (await client.hget(KEYS.job("slow"), "worker")).decode()
            watch_until = time.monotonic() + 4 * lease_s
            while time.monotonic() < watch_until:
                assert await status_of(client, "slow") == "running", "job ended before the lease was tested"
                assert (await client.hget(KEYS.job("slow"), "worker")).decode() == owner
                await asyncio.sleep(0.1)
            await client.set(KEYS.cancel("slow"), "1")
            await client.publish(KEYS.control, msgpack.packb({"type": "cancel", "id": "slow"}))
            views = await wait_terminal(client, ["slow"])
    # Both workers are gone: every event they published reaches the listener before this one.
    await client.publish(KEYS.events("slow"), msgpack.packb({"type": "end"}))
    await asyncio.wait_for(listener, WAIT_S)
    await pubsub.aclose()
    view = views["slow"]
    assert view["status"] == "cancelled"
    assert view["worker"] == owner
    assert view["attempts"] == 1 and view["resumed_from"] == 0
    assert len(finals) == 1
    await client.aclose()


async def test_token_events_carry_text_deltas_that_add_up_to_the_output(redis_url, engine_factory):
    client = aioredis.Redis.from_url(redis_url)
    spec = JobSpec(id="stream", prompt="stream me", params=SamplingParams(max_tokens=24, ignore_eos=True, temperature=0))
    pubsub = client.pubsub()
    await pubsub.subscribe(KEYS.events("stream"))
    events: list[dict] = []

    async def listen():
        async for message in pubsub.listen():
            if message["type"] == "message":
                event = msgpack.unpackb(message["data"], raw=False)
                events.append(event)
                if event["type"] == "final":
                    return

    listener = asyncio.create_task(listen())
    async with running_worker(redis_url, engine_factory()):
        await xadd_job(client, spec)
        views = await wait_terminal(client, ["stream"])
        await asyncio.wait_for(listener, WAIT_S)
    await pubsub.aclose()
    output = views["stream"]["output"]
    tokens = [e for e in events if e["type"] == "token"]
    assert len(tokens) >= 2, "a 24-token job streams over several steps"
    assert "".join(e["text"] for e in tokens) == output["text"]
    assert [t for e in tokens for t in e["token_ids"]] == output["token_ids"]
    assert [e["index"] for e in tokens] == [sum(len(x["token_ids"]) for x in tokens[:i]) for i in range(len(tokens))]
    await client.aclose()
