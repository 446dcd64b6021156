"""A key carpool reads as a stream that holds another Redis type (a producer used to list queues RPUSHes to a
lane's name): the worker says which key, leaves it out and serves every other lane; once the key is deleted it
reads the lane again. The gateway answers a submission to that lane 503 naming the fault, not 500."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
import redis.asyncio as aioredis

from gateway.app import init_app
from gateway.config import GatewayConfig
from scheduler.params import SamplingParams
from scheduler.protocol.job import JobSpec
from scheduler.protocol.lanes import Lane
from tests.harness.gateway_server import GatewayTestServer
from tests.harness.worker_harness import KEYS, running_worker, wait_terminal, wait_until, xadd_job

PARAMS = SamplingParams(max_tokens=2, temperature=0)


@pytest.fixture
def engine(tiny_model):
    from worker.engine.engine import Engine

    return Engine(model=tiny_model(), max_num_seqs=4)


async def test_a_lane_of_another_type_is_left_out_and_every_other_lane_served(redis_url, engine, caplog) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.rpush(KEYS.lane(Lane.BATCH), "oops")  # before the worker starts: its group cannot be made
        with caplog.at_level(logging.INFO):
            async with running_worker(redis_url, engine) as service:
                await xadd_job(client, JobSpec(id="standard-1", prompt="served", params=PARAMS))
                assert (await wait_terminal(client, ["standard-1"]))["standard-1"]["status"] == "succeeded"
                # Made another type while the worker runs: said, left out, and the other lanes go on.
                await client.delete(KEYS.lane(Lane.STANDARD))
                await client.rpush(KEYS.lane(Lane.STANDARD), "oops")
                await xadd_job(client, JobSpec(id="interactive-1", prompt="served", params=PARAMS,
                                               lane=Lane.INTERACTIVE))
                assert (await wait_terminal(client, ["interactive-1"]))["interactive-1"]["status"] == "succeeded"
                await wait_until(lambda: KEYS.lane(Lane.STANDARD) in service.consumer.tenants.wrong_type,
                                 "the standard lane found to be a list")
                # Deleted, the lane is a stream again (made with its group) and read.
                await client.delete(KEYS.lane(Lane.BATCH), KEYS.lane(Lane.STANDARD))
                await wait_until(lambda: not service.consumer.tenants.wrong_type, "both lanes read again")
                # A key routing keeps (the lane's active tenants, a set) made another type: said, and the lanes'
                # own streams are still read.
                await client.set(KEYS.lane_tenants(Lane.STANDARD), "oops")
                await xadd_job(client, JobSpec(id="standard-3", prompt="served", params=PARAMS))
                assert (await wait_terminal(client, ["standard-3"]))["standard-3"]["status"] == "succeeded"
                await wait_until(lambda: KEYS.lane_tenants(Lane.STANDARD) in service.consumer.tenants.wrong_type,
                                 "the active-tenant set found to be a string")
                await client.delete(KEYS.lane_tenants(Lane.STANDARD))
                await wait_until(lambda: not service.consumer.tenants.wrong_type, "the set used again")
                await xadd_job(client, JobSpec(id="batch-1", prompt="served", params=PARAMS, lane=Lane.BATCH))
                await xadd_job(client, JobSpec(id="standard-2", prompt="served", params=PARAMS))
                views = await wait_terminal(client, ["batch-1", "standard-2"])
                assert {v["status"] for v in views.values()} == {"succeeded"}, views
                assert not service.stopped.is_set()
    finally:
        await client.aclose()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    for lane in (Lane.BATCH, Lane.STANDARD):
        [line] = [m for m in said if m.startswith(f"key {KEYS.lane(lane)} holds a Redis list, not the stream")]
        assert "no job is read from it (other streams are) until it is deleted" in line
    assert [m for m in said if m.startswith(f"key {KEYS.lane_tenants(Lane.STANDARD)} holds a Redis string, not the "
                                            "set carpool keeps there")]
    assert not [r for r in caplog.records if r.exc_info], "no traceback"


async def test_a_submission_to_a_lane_of_another_type_is_a_503_naming_the_fault(redis_url) -> None:
    client = aioredis.Redis.from_url(redis_url)
    server = GatewayTestServer(init_app(GatewayConfig(redis_url=redis_url, no_webhooks=True)), host="127.0.0.1")
    await server.start_server()
    try:
        await client.rpush(KEYS.lane(Lane.BATCH), "oops")
        async with aiohttp.ClientSession() as session:
            async with session.post(str(server.make_url("/v1/jobs")), json={"prompt": "x", "lane": "batch"}) as resp:
                assert resp.status == 503, await resp.text()
                error = (await resp.json())["error"]
            async with session.post(str(server.make_url("/v1/jobs")), json={"prompt": "x"}) as ok:
                assert ok.status == 202, await ok.text()
        assert error["type"] == "unavailable" and "holds another Redis type" in error["message"], error
    finally:
        await server.close()
        await client.aclose()


async def test_a_wake_stream_of_another_type_does_not_turn_the_idle_read_into_a_busy_loop(redis_url, engine,
                                                                                          caplog) -> None:
    """The idle read blocks on the lanes without the wake stream, instead of failing at once and trying again;
    jobs are still served."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        with caplog.at_level(logging.INFO):
            async with running_worker(redis_url, engine, read_block_ms=500):
                await client.delete(KEYS.wake)
                await client.rpush(KEYS.wake, "oops")
                await xadd_job(client, JobSpec(id="served", prompt="served", params=PARAMS))
                assert (await wait_terminal(client, ["served"]))["served"]["status"] == "succeeded"
                await client.config_resetstat()
                await asyncio.sleep(2.0)  # idle: four blocking reads' worth
                stats = await client.info("commandstats")
                reads = stats.get("cmdstat_xreadgroup", {}).get("calls", 0)
                assert reads < 60, f"{reads} XREADGROUPs in 2 s of idling"
    finally:
        await client.aclose()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert [m for m in said if m.startswith(f"key {KEYS.wake} holds a Redis list, not the stream")], said


async def test_a_stop_hands_back_every_job_whose_stream_is_still_a_stream(redis_url, engine) -> None:
    """One lane stream replaced by a list while its job runs: the stop still hands back the job of another lane
    (its checkpoint kept, its entry made idle for the next worker), instead of failing the whole hand-back."""
    client = aioredis.Redis.from_url(redis_url)
    held = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    try:
        async with running_worker(redis_url, engine, checkpoint_tokens=2, shutdown_grace_s=0.0):
            await xadd_job(client, JobSpec(id="kept", prompt="a held job", params=held))
            await xadd_job(client, JobSpec(id="gone", prompt="a held job", params=held, lane=Lane.BATCH))
            for job_id in ("kept", "gone"):
                await wait_until(lambda job_id=job_id: client.hget(KEYS.job(job_id), "checkpoint"),
                                 f"{job_id} running")
            await client.delete(KEYS.lane(Lane.BATCH))
            await client.rpush(KEYS.lane(Lane.BATCH), "oops")
        handbacks = await client.hget(KEYS.job("kept"), "handbacks")
        [pending] = await client.xpending_range(KEYS.lane(Lane.STANDARD), "carpool-workers", "-", "+", 1)
    finally:
        await client.aclose()
    assert handbacks == b"1" and pending["time_since_delivered"] > 60_000, (handbacks, pending)


async def test_a_tenant_stream_of_another_type_keeps_its_jobs_in_the_lane_and_routing_going(redis_url, engine,
                                                                                            caplog) -> None:
    """A tenant's stream made another type: that tenant's jobs stay in the lane stream and are served from there
    (said once, naming the key), other tenants' jobs behind them are still routed into their own streams; once
    the key is deleted the tenant's jobs are routed again."""
    client = aioredis.Redis.from_url(redis_url)
    broken, other = KEYS.tenant_lane(Lane.STANDARD, "acme"), KEYS.tenant_lane(Lane.STANDARD, "globex")
    try:
        await client.set(broken, "oops")
        with caplog.at_level(logging.INFO):
            async with running_worker(redis_url, engine) as service:
                await xadd_job(client, JobSpec(id="acme-1", prompt="served", params=PARAMS, tenant="acme"))
                await xadd_job(client, JobSpec(id="globex-1", prompt="served", params=PARAMS, tenant="globex"))
                views = await wait_terminal(client, ["acme-1", "globex-1"])
                assert {v["status"] for v in views.values()} == {"succeeded"}, views
                assert await client.xlen(other) == 0 and await client.exists(other), "globex's job was routed"
                await wait_until(lambda: broken in service.consumer.tenants.wrong_type, "acme's stream found")
                await client.delete(broken)
                await xadd_job(client, JobSpec(id="acme-2", prompt="served", params=PARAMS, tenant="acme"))
                assert (await wait_terminal(client, ["acme-2"]))["acme-2"]["status"] == "succeeded"
                assert await client.exists(broken), "acme's job was routed into its stream again"
                await wait_until(lambda: not service.consumer.tenants.wrong_type, "acme's stream used again")
                assert not service.stopped.is_set()
    finally:
        await client.aclose()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len([m for m in said if m.startswith(f"key {broken} holds a Redis string, not the stream")]) == 1, said
    assert not [r for r in caplog.records if r.exc_info], "no traceback"


async def test_a_blocking_read_unblocked_by_its_stream_deleted_goes_on(redis_url: str, engine, caplog) -> None:
    """Redis 7 ends a blocking XREADGROUP whose stream is deleted with an error (``UNBLOCKED the stream key no
    longer exists``; 6.2 lets it time out): the worker makes the stream again, with its group, and serves on,
    rather than taking the error for its intake failing and stopping."""
    from tests.harness.redis_proxy import RedisProxy

    proxy = await RedisProxy(redis_url).start()
    client = aioredis.Redis.from_url(redis_url)
    try:
        with caplog.at_level(logging.INFO):
            async with running_worker(proxy.url, engine, read_block_ms=300) as service:
                await client.delete(KEYS.lane(Lane.BATCH))  # as if deleted while the read waited on it
                proxy.answer(b"XREADGROUP", b"BLOCK", reply=b"-UNBLOCKED the stream key no longer exists\r\n")
                await wait_until(lambda: proxy.num_answered == 1, "the blocking read unblocked")
                await xadd_job(client, JobSpec(id="after", prompt="served", params=PARAMS, lane=Lane.BATCH))
                assert (await wait_terminal(client, ["after"]))["after"]["status"] == "succeeded"
                assert not service.stopped.is_set()
    finally:
        await client.aclose()
        await proxy.aclose()
    assert [r for r in caplog.records if r.getMessage().startswith(f"stream {KEYS.lane(Lane.BATCH)} had no consumer "
                                                                   "group")]
    assert not [r for r in caplog.records if r.exc_info], "no traceback"
