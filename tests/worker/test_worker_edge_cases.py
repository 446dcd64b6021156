"""Worker edge cases from outside: redis-cli (JSON) producers, entries in a lane their job does not name, dropped connections."""

from __future__ import annotations

import asyncio
import json

import msgpack
import pytest
import redis.asyncio as aioredis

from scheduler.params import SamplingParams
from scheduler.protocol.job import JobSpec
from scheduler.protocol.keys import CONSUMER_GROUP
from scheduler.protocol.lanes import Lane
from tests.harness.redis_proxy import RedisProxy
from tests.harness.worker_harness import KEYS, has_status, running_worker, status_of, wait_terminal, wait_until, xadd_job

HELD_TOKENS = 1500
"""Most of the tiny model's context (2048): far more steps than pass while a test acts on a running job (a few
Redis round trips and a reclaim period), however fast the engine."""


@pytest.fixture
def engine(tiny_model):
    from worker.engine.engine import Engine

    return Engine(model=tiny_model(), max_num_seqs=8, policy="priority")


@pytest.fixture
def long_engine(tiny_model):
    """An engine on a long-context model, for a job that must still be running when it is cancelled."""
    from worker.engine.engine import Engine

    return Engine(model=tiny_model(max_position_embeddings=16384), max_num_seqs=8, policy="priority")


async def test_invalid_json_job_with_an_id_is_marked_failed(redis_url, engine):
    client = aioredis.Redis.from_url(redis_url)
    lane = KEYS.lane(Lane.STANDARD)
    async with running_worker(redis_url, engine):
        body = {"v": 1, "id": "json-bad", "prompt": "x", "params": {"max_tokenz": 3}, "traceparent": "junk"}
        await client.xadd(lane, {"job": json.dumps(body)})
        views = await wait_terminal(client, ["json-bad"])
    view = views["json-bad"]
    assert view["status"] == "failed"
    assert view["error"]["type"] == "invalid_job"
    assert view["error"]["field"] == "params.max_tokenz"
    assert await client.xlen(KEYS.dead) == 1
    assert (await client.xpending(lane, CONSUMER_GROUP))["pending"] == 0
    await client.aclose()


async def test_token_ids_past_the_vocabulary_fail_naming_the_field_the_producer_sent(redis_url, engine):
    """A direct producer's `prompt_token_ids` reach the engine unchecked (no gateway knew the vocabulary): the
    failed job names `prompt_token_ids`, not the engine's own name for it."""
    client = aioredis.Redis.from_url(redis_url)
    async with running_worker(redis_url, engine):
        await xadd_job(client, JobSpec(id="oov", prompt_token_ids=[1, engine.vocab_size + 5]))
        views = await wait_terminal(client, ["oov"])
    await client.aclose()
    error = views["oov"]["error"]
    assert views["oov"]["status"] == "failed" and error["field"] == "prompt_token_ids", error
    assert error["message"].startswith(f"prompt_token_ids: token id {engine.vocab_size + 5} is outside"), error


async def test_stop_tokens_past_the_vocabulary_are_harmless_under_min_tokens(redis_url, engine):
    """min_tokens masks the stop tokens in the logits until it is met: an id past the vocabulary (one list of
    stop ids for models of several vocabularies) can never be drawn, so it is left out of the mask rather than
    indexing past the logits, which would stop the worker and every job batched with it."""
    client = aioredis.Redis.from_url(redis_url)
    lane = KEYS.lane(Lane.STANDARD)
    vocab_size = engine.runner.vocab_size
    allowed = 65  # the one id that is not a stop token
    stops = [t for t in range(vocab_size + 8) if t != allowed]  # and a few past the vocabulary
    async with running_worker(redis_url, engine) as service:
        for i in range(4):
            body = {"v": 1, "id": f"stops-{i}", "prompt": "hello",
                    "params": {"stop_token_ids": stops, "min_tokens": 1 + i, "max_tokens": 8, "ignore_eos": True}}
            await client.xadd(lane, {"job": json.dumps(body)})
        views = await wait_terminal(client, [f"stops-{i}" for i in range(4)])
        assert not service.has_failed and not service.stopped.is_set()
    for i in range(4):
        view = views[f"stops-{i}"]
        assert view["status"] == "succeeded"
        # Until min_tokens every stop id is masked, so only the allowed id can be drawn.
        assert view["output"]["token_ids"][: 1 + i] == [allowed] * (1 + i)
    await client.aclose()


async def test_a_prompt_far_past_the_context_is_refused_untokenized_and_the_rest_run(redis_url, engine):
    client = aioredis.Redis.from_url(redis_url)
    lane = KEYS.lane(Lane.STANDARD)
    huge = "a" * (engine.max_prompt_chars + 1)
    async with running_worker(redis_url, engine):
        await client.xadd(lane, {"job": json.dumps({"v": 1, "id": "huge", "prompt": huge})})
        await client.xadd(lane, {"job": json.dumps({"v": 1, "id": "huge-chat", "messages": [
            {"role": "user", "content": huge}]})})
        await client.xadd(lane, {"job": json.dumps({"v": 1, "id": "small", "prompt": "hi",
                                                     "params": {"max_tokens": 3}})})
        views = await wait_terminal(client, ["huge", "huge-chat", "small"])
    for job_id, field in (("huge", "prompt"), ("huge-chat", "messages")):
        error = views[job_id]["error"]
        assert views[job_id]["status"] == "failed" and error["field"] == field
        assert "characters" in error["message"] and "cannot fit" in error["message"]  # its length, not its tokens
        assert error["code"] == "context_length_exceeded"
    assert views["small"]["status"] == "succeeded"
    await client.aclose()


async def test_direct_job_without_a_lane_field_belongs_to_the_lane_it_was_added_to(redis_url, engine):
    client = aioredis.Redis.from_url(redis_url)
    async with running_worker(redis_url, engine):
        body = {"v": 1, "id": "nightly", "prompt": "Summarise", "params": {"max_tokens": 3, "temperature": 0}}
        await client.xadd(KEYS.lane(Lane.BATCH), {"job": json.dumps(body)})
        views = await wait_terminal(client, ["nightly"])
    assert views["nightly"]["status"] == "succeeded"
    assert views["nightly"]["lane"] == "batch"
    await client.aclose()


async def _drop_other_connections(client: aioredis.Redis) -> int:
    me = await client.client_id()
    killed = 0
    for info in await client.client_list():
        if int(info["id"]) != me:
            killed += await client.client_kill_filter(_id=int(info["id"]))
    return killed


async def test_worker_survives_dropped_redis_connections(redis_url, long_engine):
    from gateway.cancel import Canceller

    client = aioredis.Redis.from_url(redis_url)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    # Checkpoints only at the first token: a later cancel can arrive only over the control channel.
    async with running_worker(redis_url, long_engine, lease_s=3.0, heartbeat_interval_s=0.1,
                              checkpoint_tokens=100_000, checkpoint_interval_s=1000.0) as service:
        await xadd_job(client, JobSpec(id="before", prompt="one", params=greedy))
        await wait_terminal(client, ["before"])
        # Every connection but ours, pub/sub and the blocked read included; again before they all came back.
        assert await _drop_other_connections(client) >= 2
        for _ in range(2):
            await asyncio.sleep(0.4)
            await _drop_other_connections(client)
        await xadd_job(client, JobSpec(id="after", prompt="two", params=greedy))
        views = await wait_terminal(client, ["after"])
        # Too long to end before the cancel reaches it, at any engine speed.
        long = SamplingParams(max_tokens=16000, temperature=0, ignore_eos=True)
        await xadd_job(client, JobSpec(id="long", prompt="three", params=long))
        await wait_until(lambda: client.hget(KEYS.job("long"), "checkpoint"), "the long job's first checkpoint")
        # Past its first checkpoint, the only one: the cancel must come over the (reconnected) control channel.
        await wait_until(lambda: len(service.job_loop.jobs["long"].token_ids) > 1, "the long job past its checkpoint")
        await Canceller(client, KEYS, flag_ttl_s=60).cancel("long")
        views |= await wait_terminal(client, ["long"])
        assert not service.stopped.is_set() and not service.has_failed
    assert views["after"]["status"] == "succeeded"
    assert views["long"]["status"] == "cancelled"
    assert 0 < views["long"]["usage"]["completion_tokens"] < 16000
    await client.aclose()


async def test_a_checkpoint_whose_write_was_lost_is_written_at_the_next_step(redis_url, engine):
    from gateway.cancel import Canceller

    client = aioredis.Redis.from_url(redis_url)
    proxy = await RedisProxy(redis_url).start()
    # The step that carries the first token event and the first checkpoint dies with its connection.
    proxy.refuse(KEYS.events_log("held").encode(), KEYS.cancel("held").encode())
    params = SamplingParams(max_tokens=HELD_TOKENS, temperature=0, ignore_eos=True)
    try:
        async with running_worker(proxy.url, engine, checkpoint_tokens=100_000, checkpoint_interval_s=1000.0):
            await xadd_job(client, JobSpec(id="held", prompt="a first checkpoint", params=params))
            await wait_until(lambda: client.hget(KEYS.job("held"), "checkpoint"), "the job's first checkpoint")
            assert proxy.num_refused == 1
            await Canceller(client, KEYS, flag_ttl_s=60).cancel("held")
            views = await wait_terminal(client, ["held"])
    finally:
        await proxy.aclose()
    assert views["held"]["status"] == "cancelled"
    await client.aclose()


async def test_a_worker_reclaiming_its_own_running_entry_keeps_running_it_once(redis_url, engine):
    client = aioredis.Redis.from_url(redis_url)
    lane = KEYS.lane(Lane.STANDARD)
    params = SamplingParams(max_tokens=HELD_TOKENS, temperature=0, ignore_eos=True)
    async with running_worker(redis_url, engine, lease_s=1.0) as service:
        entry_id = await xadd_job(client, JobSpec(id="slow", prompt="renewed late", params=params))
        await wait_until(lambda: client.hget(KEYS.job("slow"), "checkpoint"), "the job's first checkpoint")
        # As if renewals came late: the entry looks idle past the lease until the worker's own reclaim takes it.
        while True:
            await client.xclaim(lane, CONSUMER_GROUP, service.config.worker_name, 0, [entry_id],
                                idle=3_600_000, justid=True)
            await asyncio.sleep(0.05)
            (pending,) = await client.xpending_range(lane, CONSUMER_GROUP, min=entry_id, max=entry_id, count=1)
            if pending["times_delivered"] >= 2:
                break  # reclaimed while it runs
        views = await wait_terminal(client, ["slow"])
    assert views["slow"]["status"] == "succeeded"
    assert views["slow"]["attempts"] == 1
    assert views["slow"]["usage"]["completion_tokens"] == HELD_TOKENS
    await client.aclose()


async def test_an_invalid_message_reusing_a_running_jobs_id_leaves_that_job_alone(redis_url, engine):
    client = aioredis.Redis.from_url(redis_url)
    params = SamplingParams(max_tokens=HELD_TOKENS, temperature=0, ignore_eos=True)
    async with running_worker(redis_url, engine, checkpoint_tokens=4):
        await xadd_job(client, JobSpec(id="taken", prompt="a real job", params=params))
        await wait_until(lambda: has_status(client, "taken", "running"), "the job running")
        garbage = {"v": 1, "id": "taken", "prompt": "x", "params": {"max_tokenz": 3}}
        await client.xadd(KEYS.lane(Lane.STANDARD), {"job": json.dumps(garbage)})
        await wait_until(lambda: client.xlen(KEYS.dead), "the invalid message dead-lettered")
        assert await status_of(client, "taken") == "running"
        views = await wait_terminal(client, ["taken"])
    assert views["taken"]["status"] == "succeeded"
    assert views["taken"]["usage"]["completion_tokens"] == HELD_TOKENS
    (dead,) = await client.xrange(KEYS.dead)
    assert dead[1][b"reason"].startswith(b"invalid job") and b"max_tokenz" in dead[1][b"reason"]
    assert dead[1][b"job_id"] == b"taken"
    await client.aclose()


def checkpointed_tokens(raw: bytes | None) -> list[int]:
    data = msgpack.unpackb(raw) if raw else []
    return list(data["token_ids"] if isinstance(data, dict) else data)


async def test_a_resumed_job_reports_the_logprobs_of_every_output_token(redis_url, engine):
    client = aioredis.Redis.from_url(redis_url)
    params = SamplingParams(max_tokens=HELD_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    async with running_worker(redis_url, engine, checkpoint_tokens=4, shutdown_grace_s=0.0, worker_name="first"):
        await xadd_job(client, JobSpec(id="lp", prompt="logprobs survive", params=params))

        async def checkpointed_8() -> bool:
            return len(checkpointed_tokens(await client.hget(KEYS.job("lp"), "checkpoint"))) >= 8

        await wait_until(checkpointed_8, "a checkpoint of 8 tokens")
    # Shut down mid-job: checkpointed and handed back.
    saved = msgpack.unpackb(await client.hget(KEYS.job("lp"), "checkpoint"))
    assert await status_of(client, "lp") == "running"
    assert len(saved["logprobs"]) == len(saved["token_ids"]) >= 8
    async with running_worker(redis_url, engine, worker_name="second"):
        views = await wait_terminal(client, ["lp"])
    view = views["lp"]
    assert view["status"] == "succeeded" and view["worker"] == "second"
    resumed_from = view["resumed_from"]
    assert resumed_from == len(saved["token_ids"])
    token_ids, logprobs = view["output"]["token_ids"], view["output"]["logprobs"]
    assert len(token_ids) == len(logprobs) == HELD_TOKENS
    assert token_ids[:resumed_from] == saved["token_ids"]
    assert logprobs[:resumed_from] == saved["logprobs"]
    assert [entry["token_id"] for entry in logprobs] == token_ids
    # Greedy: every token is its step's most likely one, before and after the resume.
    assert all(entry["top_logprobs"][0]["token_id"] == entry["token_id"] for entry in logprobs)
    assert all(len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0 for entry in logprobs)
    await client.aclose()


async def test_a_running_job_whose_record_vanishes_is_stopped_saying_so(redis_url, long_engine, caplog):
    """Its record deleted from outside (or lost by a Redis restart without persistence): the worker's next
    checkpoint finds no record, and the worker stops its copy saying that, not that another worker took it."""
    client = aioredis.Redis.from_url(redis_url)
    params = SamplingParams(max_tokens=16000, temperature=0, ignore_eos=True)
    with caplog.at_level("WARNING", logger="worker.job_loop"):
        async with running_worker(redis_url, long_engine, checkpoint_tokens=4) as service:
            await xadd_job(client, JobSpec(id="vanishing", prompt="x", params=params))
            await wait_until(lambda: client.hget(KEYS.job("vanishing"), "checkpoint"), "the first checkpoint")
            await client.delete(KEYS.job("vanishing"))
            await wait_until(lambda: "vanishing" not in service.job_loop.jobs, "the worker stopping its copy")
    await client.aclose()
    (line,) = [r.getMessage() for r in caplog.records if "stopping our copy" in r.getMessage()]
    assert line == ("job vanishing: its record is gone (deleted, or lost by Redis: a restart without "
                    "persistence?); stopping our copy")


async def test_an_entry_id_from_the_future_gives_no_negative_wait(redis_url, engine):
    """A producer's explicit id far ahead (and every `*` id after it in that lane) is no time a job waited from:
    its record says it was created when the worker met it at the latest, and no timing is negative."""
    client = aioredis.Redis.from_url(redis_url)
    params = {"max_tokens": 2, "temperature": 0}
    for job_id, entry_id in (("ahead", "9999999999999-0"), ("after-it", "*")):
        await client.xadd(KEYS.lane(Lane.INTERACTIVE), {"job": json.dumps(
            {"v": 1, "id": job_id, "prompt": "x", "params": params})}, id=entry_id)
    async with running_worker(redis_url, engine):
        views = await wait_terminal(client, ["ahead", "after-it"])
    await client.aclose()
    for view in views.values():
        assert view["status"] == "succeeded" and view["created_at"] <= view["started_at"], view
        assert all(value >= 0 for value in view["timings"].values()), view["timings"]
