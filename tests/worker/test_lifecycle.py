"""A job's life through a real gateway, Redis and worker: what a cancel keeps, what a hand-back counts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiohttp import ClientSession

from scheduler.params import SamplingParams
from tests.harness.worker_harness import KEYS, running_worker, wait_terminal


@pytest.fixture
def make_engine(tiny_model: Callable[..., str]) -> Callable[..., Any]:
    from worker.engine.engine import Engine

    return lambda **kw: Engine(model=kw.pop("model", None) or tiny_model(), max_num_seqs=kw.pop("max_num_seqs", 4),
                               **kw)


async def _wait_checkpoint(client: aioredis.Redis, job_id: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not await client.hget(KEYS.job(job_id), "checkpoint"):
        assert time.monotonic() < deadline, f"{job_id} never checkpointed"
        await asyncio.sleep(0.05)


LONG = {"prompt": "tell me everything", "params": {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}}


async def test_cancelling_a_running_job_keeps_its_partial_output(
    gateway_url: str, redis_url: str, make_engine: Callable[..., Any]
) -> None:
    engine = make_engine()
    client = aioredis.Redis.from_url(redis_url)
    try:
        async with running_worker(redis_url, engine, checkpoint_tokens=4), ClientSession() as http:
            async with http.post(f"{gateway_url}/v1/jobs", json={"id": "cancel-me", **LONG}) as resp:
                assert resp.status == 202
            await _wait_checkpoint(client, "cancel-me")
            async with http.delete(f"{gateway_url}/v1/jobs/cancel-me") as resp:
                assert resp.status in (200, 202), await resp.text()
            views = await wait_terminal(client, ["cancel-me"], timeout_s=30)
            async with http.get(f"{gateway_url}/v1/jobs/cancel-me") as resp:
                view = await resp.json()
    finally:
        await client.aclose()
    assert views["cancel-me"]["status"] == view["status"] == "cancelled"
    output = view["output"]
    assert output is not None and output["finish_reason"] == "abort"
    assert 0 < len(output["token_ids"]) == view["usage"]["completion_tokens"] < 1500
    (expected,) = engine.generate([LONG["prompt"]], SamplingParams(
        max_tokens=len(output["token_ids"]), ignore_eos=True, temperature=0))
    # The text released so far: a trailing partial UTF-8 character is held back until it completes.
    assert output["token_ids"] == expected.token_ids and output["text"] and expected.text.startswith(output["text"])


async def _progress(client: aioredis.Redis, job_id: str, beyond: int, timeout_s: float = 60) -> int:
    """Wait until the job's checkpoint holds more than `beyond` tokens; returns how many it holds."""
    from worker.job_store import unpack_checkpoint

    deadline = time.monotonic() + timeout_s
    while True:
        raw = await client.hget(KEYS.job(job_id), "checkpoint")
        if raw and len(unpack_checkpoint(raw)[0]) > beyond:
            return len(unpack_checkpoint(raw)[0])
        assert time.monotonic() < deadline, f"{job_id} made no progress beyond {beyond} tokens"
        await asyncio.sleep(0.05)


async def _attempts(client: aioredis.Redis, job_id: str, attempts: int, timeout_s: float = 60) -> None:
    """Wait until the job has been started `attempts` times."""
    deadline = time.monotonic() + timeout_s
    while int(await client.hget(KEYS.job(job_id), "attempts") or 0) < attempts:
        assert time.monotonic() < deadline, f"{job_id} was not started a {attempts}th time"
        await asyncio.sleep(0.05)


LONG_CONTEXT = 8192
HELD_TOKENS = 4096
"""Over ten times what four restart windows (from progress seen to the worker's exit) produce on an idle machine."""
RESTARTS = {"checkpoint_tokens": 4, "shutdown_grace_s": 0.0, "max_deliveries": 2, "lease_s": 600.0}
"""Each worker hands back at once on shutdown; leases long enough that only a hand-back moves a job."""


async def test_clean_hand_backs_do_not_count_towards_max_deliveries(
    gateway_url: str, redis_url: str, make_engine: Callable[..., Any], tiny_model: Callable[..., str]
) -> None:
    # Far more tokens than four restarts' windows produce (a window lasts from the progress seen to the worker's
    # exit): the job is still running at the fourth start.
    engine = make_engine(model=tiny_model(max_position_embeddings=LONG_CONTEXT))
    client = aioredis.Redis.from_url(redis_url)
    body = {"id": "restarted", "prompt": "a long story",
            "params": {"max_tokens": HELD_TOKENS, "ignore_eos": True, "temperature": 0}}
    try:
        async with ClientSession() as http:
            async with http.post(f"{gateway_url}/v1/jobs", json=body) as resp:
                assert resp.status == 202
            done = 0
            for restart in range(4):  # four clean restarts: deliveries 1..4, max_deliveries 2
                async with running_worker(redis_url, engine, **RESTARTS):
                    await _attempts(client, "restarted", restart + 1)
                    done = await _progress(client, "restarted", done + 4)
                    if restart:
                        async with http.get(f"{gateway_url}/v1/jobs/restarted") as resp:
                            running = await resp.json()
                        assert running["status"] == "running" and running["resumed_from"] > 0, running
            async with running_worker(redis_url, engine, **RESTARTS):
                views = await wait_terminal(client, ["restarted"])
    finally:
        await client.aclose()
    view = views["restarted"]
    assert view["status"] == "succeeded", view["error"]
    (expected,) = engine.generate([body["prompt"]], SamplingParams(max_tokens=HELD_TOKENS, ignore_eos=True,
                                                                   temperature=0))
    assert view["output"]["token_ids"] == expected.token_ids and view["resumed_from"] > 0


async def test_a_job_failed_for_too_many_deliveries_keeps_its_checkpointed_output(
    redis_url: str, make_engine: Callable[..., Any]
) -> None:
    from scheduler.protocol.job import JobSpec
    from scheduler.protocol.keys import CONSUMER_GROUP
    from tests.harness.worker_harness import xadd_job

    engine = make_engine()
    client = aioredis.Redis.from_url(redis_url)
    spec = JobSpec(id="doomed", prompt="a long story", params=SamplingParams(max_tokens=300, ignore_eos=True))
    settings = {**RESTARTS, "max_deliveries": 3}
    try:
        entry_id = await xadd_job(client, spec)
        async with running_worker(redis_url, engine, **settings):
            await _progress(client, "doomed", 8)
        # Workers that claimed it and died (each claim counts a delivery, none a clean hand-back).
        for _ in range(3):
            await client.xclaim(KEYS.lane(spec.lane), CONSUMER_GROUP, "died", 0, [entry_id], idle=10**9)
        async with running_worker(redis_url, engine, **settings):
            views = await wait_terminal(client, ["doomed"], timeout_s=60)
        from worker.job_store import unpack_checkpoint

        checkpoint, _ = unpack_checkpoint(await client.hget(KEYS.job("doomed"), "checkpoint"))
    finally:
        await client.aclose()
    view = views["doomed"]
    assert view["status"] == "failed" and view["error"]["type"] == "too_many_deliveries"
    # Five deliveries, one run: the message says why the record's attempts are fewer than its deliveries.
    assert view["attempts"] == 1 and "delivered 5 times" in view["error"]["message"], view
    assert "does not run it again" in view["error"]["message"]
    assert view["output"]["token_ids"] == checkpoint and len(checkpoint) > 8
    assert view["output"]["text"]
    prompt_ids = engine.generate([spec.prompt], SamplingParams(max_tokens=1))[0].prompt_token_ids
    assert view["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(checkpoint),
                             "cached_tokens": 0} and prompt_ids


async def test_a_second_entry_of_a_running_job_delivered_too_often_leaves_the_job_running(
    redis_url: str, make_engine: Callable[..., Any]
) -> None:
    """A producer XADDed a job's id twice and the second copy's consumer died, often: that copy's deliveries
    say nothing of the job, which finishes from its own entry, with its own reply stream."""
    from scheduler.protocol.job import JobSpec
    from scheduler.protocol.keys import CONSUMER_GROUP
    from tests.harness.worker_harness import HeldReplies, has_status, wait_until, xadd_job

    client = aioredis.Redis.from_url(redis_url)
    spec = JobSpec(id="twice", prompt="a story", reply_to="replies:twice",
                   params=SamplingParams(max_tokens=200, ignore_eos=True, temperature=0))
    lane = KEYS.lane(spec.lane)
    engine = HeldReplies(make_engine())

    async def dead_lettered() -> bool:
        return await client.xlen(KEYS.dead) > 0

    try:
        await client.xgroup_create(lane, CONSUMER_GROUP, id="0", mkstream=True)
        second = await xadd_job(client, JobSpec(id="twice", prompt="a story"))
        await client.xreadgroup(CONSUMER_GROUP, "died", {lane: ">"}, count=1)  # the second copy only
        await xadd_job(client, spec)
        async with running_worker(redis_url, engine, max_deliveries=2, lease_s=2.0, checkpoint_tokens=4):
            await wait_until(lambda: has_status(client, "twice", "running"), "the job runs from its entry")
            await engine.hold()  # the job cannot finish while the second copy is reclaimed
            await client.xclaim(lane, CONSUMER_GROUP, "died", 0, [second], idle=10**9, retrycount=10)
            await wait_until(dead_lettered, "the second copy is dead-lettered")
            assert await has_status(client, "twice", "running")
            await engine.release()
            views = await wait_terminal(client, ["twice"], timeout_s=60)
            dead = await client.xrange(KEYS.dead)
        replies = await client.xrange("replies:twice")
    finally:
        await client.aclose()
    assert views["twice"]["status"] == "succeeded", views["twice"]
    assert len(views["twice"]["output"]["token_ids"]) == 200 and len(replies) == 1
    ((_, letter),) = dead
    assert letter[b"entry_id"].decode() == second and b"second entry" in letter[b"reason"]


async def test_cancelling_a_job_whose_worker_stopped_keeps_its_checkpointed_output(
    gateway_url: str, redis_url: str, make_engine: Callable[..., Any]
) -> None:
    """The job ran, its worker went away (here: handed it back), and it was cancelled before another took it:
    the next worker commits it cancelled with the tokens it had checkpointed, as a cancel while running does."""
    from worker.job_store import unpack_checkpoint

    engine = make_engine()
    client = aioredis.Redis.from_url(redis_url)
    try:
        async with ClientSession() as http:
            async with http.post(f"{gateway_url}/v1/jobs", json={"id": "orphan", **LONG}) as resp:
                assert resp.status == 202
            async with running_worker(redis_url, engine, **RESTARTS):
                await _progress(client, "orphan", 8)
            checkpoint, _ = unpack_checkpoint(await client.hget(KEYS.job("orphan"), "checkpoint"))
            async with http.delete(f"{gateway_url}/v1/jobs/orphan") as resp:
                assert resp.status == 202 and (await resp.json())["status"] == "running"
            async with running_worker(redis_url, engine, **RESTARTS):
                views = await wait_terminal(client, ["orphan"], timeout_s=30)
    finally:
        await client.aclose()
    view = views["orphan"]
    assert view["status"] == "cancelled" and view["error"]["message"].startswith("cancelled while running"), view
    assert view["output"]["finish_reason"] == "abort" and view["output"]["token_ids"] == checkpoint
    assert len(checkpoint) > 8 and view["usage"]["completion_tokens"] == len(checkpoint)
    # The checkpoint keeps the prompt's length too: a cancelled job's usage counts its prompt.
    prompt_ids = engine.generate([LONG["prompt"]], SamplingParams(max_tokens=1))[0].prompt_token_ids
    assert view["usage"]["prompt_tokens"] == len(prompt_ids) > 0


async def test_a_producers_xadd_of_an_id_the_gateway_queued_runs_nothing_of_its_own(
    gateway_url: str, redis_url: str, make_engine: Callable[..., Any]
) -> None:
    """The gateway answered 202 for job `mixed`; a producer then XADDs the same id into a lane read first. The
    job that runs is the gateway's (its prompt, its reply stream); the producer's copy is only acknowledged."""
    import msgpack

    client = aioredis.Redis.from_url(redis_url)
    async with ClientSession() as http:
        async with http.post(f"{gateway_url}/v1/jobs", json={
                "id": "mixed", "prompt": "from the gateway", "lane": "batch", "reply_to": "mixed-replies",
                "params": {"max_tokens": 9, "temperature": 0, "ignore_eos": True}}) as resp:
            assert resp.status == 202
    await client.xadd(KEYS.lane("interactive"), {"job": msgpack.packb(
        {"v": 1, "id": "mixed", "prompt": "direct", "params": {"max_tokens": 5, "ignore_eos": True}})})
    try:
        async with running_worker(redis_url, make_engine()):
            views = await wait_terminal(client, ["mixed"])
            replies = await client.xrange("mixed-replies")
            lanes = [await client.xlen(KEYS.lane(lane)) for lane in ("interactive", "batch")]
    finally:
        await client.aclose()
    view = views["mixed"]
    assert view["status"] == "succeeded" and len(view["output"]["token_ids"]) == 9, view
    assert view["usage"]["prompt_tokens"] == len("from the gateway".encode()) + 1  # the byte tokenizer, plus BOS
    assert len(replies) == 1 and lanes == [0, 0]


async def test_entries_of_one_id_read_together_start_the_job_of_the_first(
    redis_url: str, make_engine: Callable[..., Any]
) -> None:
    """A producer XADDs each id twice, a different prompt each time, and one read takes them all: every job is
    the first entry's, as the lane's order says, and each id runs once."""
    import msgpack

    client = aioredis.Redis.from_url(redis_url)
    ids = [f"order-{i}" for i in range(8)]
    for job_id in ids:
        for prompt in ("first", "second copy"):
            await client.xadd(KEYS.lane("standard"), {"job": msgpack.packb(
                {"v": 1, "id": job_id, "prompt": prompt, "reply_to": "order-replies",
                 "params": {"max_tokens": 2, "temperature": 0}})})
    from tests.harness.worker_harness import wait_until

    try:
        async with running_worker(redis_url, make_engine(max_num_seqs=16)) as worker:
            views = await wait_terminal(client, ids)

            async def every_entry_taken() -> bool:  # a copy that ran would have replied before its entry went
                return await client.xlen(KEYS.lane("standard")) == 0 and not worker.intake.admitting

            await wait_until(every_entry_taken, "all 16 entries acknowledged")
            replies = await client.xlen("order-replies")
    finally:
        await client.aclose()
    # The byte tokenizer: "first" is 5 tokens and a BOS, "second copy" 12.
    assert {job_id: view["usage"]["prompt_tokens"] for job_id, view in views.items()} == {job_id: 6 for job_id in ids}
    assert replies == len(ids)


async def test_a_job_that_cannot_be_admitted_fails_where_its_producer_waits(
    redis_url: str, make_engine: Callable[..., Any]
) -> None:
    """An entry whose admission keeps failing (here: a key the start writes to holds another type) is failed on
    its last delivery as `unadmittable`, and its producer hears of it as of any failed job: one entry on its
    reply stream and a `completed` webhook delivery queued. The entry goes to the dead stream with its job id."""
    import msgpack

    client = aioredis.Redis.from_url(redis_url)
    await client.set(KEYS.events_log("stuck"), "not a stream")
    await client.xadd(KEYS.lane("standard"), {"job": msgpack.packb(
        {"v": 1, "id": "stuck", "prompt": "hi", "reply_to": "stuck-replies",
         "webhook": {"url": "https://example.com/hook", "events": ["completed"]}})})
    try:
        async with running_worker(redis_url, make_engine(), max_deliveries=1):
            views = await wait_terminal(client, ["stuck"])
        replies = await client.xrange("stuck-replies")
        deliveries = [fields for _, fields in await client.xrange(KEYS.webhooks)]
        dead = [fields for _, fields in await client.xrange(KEYS.dead)]
    finally:
        await client.aclose()
    assert views["stuck"]["status"] == "failed" and views["stuck"]["error"]["type"] == "unadmittable"
    assert len(replies) == 1 and msgpack.unpackb(replies[0][1][b"result"])["status"] == "failed"
    assert [d[b"event"] for d in deliveries if d.get(b"job_id") == b"stuck"] == [b"completed"], deliveries
    assert [d[b"job_id"] for d in dead] == [b"stuck"]


async def test_a_directly_xadded_job_has_a_record_that_expires_even_while_it_runs(redis_url: str) -> None:
    """The record a worker makes for a job XADDed straight into a lane gets the gateway's backstop time to live
    (`--queued-ttl-s`'s default, a week) at once, so a job that never ends (its entry deleted by hand, say)
    leaves no record forever; its end gives it the result's."""
    from scheduler.protocol.job import JobSpec
    from scheduler.protocol.keys import DEFAULT_QUEUED_TTL_S
    from scheduler.protocol.state_machine import StartVerdict
    from worker.job_store import EntryRef, JobStore

    client = aioredis.Redis.from_url(redis_url)
    store = JobStore(client, KEYS, worker="w1", result_ttl_s=60, reply_maxlen=10, dead_maxlen=10)
    try:
        start = await store.start(JobSpec(id="direct", prompt="x"), EntryRef(KEYS.lane("standard"), "1-0"),
                                  time.time(), time.time(), "token-1")
        assert start.verdict is StartVerdict.RUN
        assert DEFAULT_QUEUED_TTL_S - 60 < await client.ttl(KEYS.job("direct")) <= DEFAULT_QUEUED_TTL_S
    finally:
        await client.aclose()


async def test_a_second_copy_that_cannot_be_admitted_leaves_the_running_job_alone(
    redis_url: str, make_engine: Callable[..., Any]
) -> None:
    """The last resort for an entry whose admission keeps failing fails its job only when the entry is the
    job's own: a copy of a job running from another entry is dead-lettered alone (naming the job), and the job,
    its reply stream and its webhooks hear nothing of it."""
    import msgpack

    from scheduler.protocol.lanes import Lane
    from worker.consumer import Entry
    from worker.job_store import EntryRef

    client = aioredis.Redis.from_url(redis_url)
    await client.hset(KEYS.job("held"), mapping={"id": "held", "status": "running",
                                                 "stream_entry": f"{KEYS.lane('batch')} 1-0"})
    copy_fields = {b"job": msgpack.packb({"v": 1, "id": "held", "prompt": "x", "reply_to": "held-replies"})}
    copy_id = await client.xadd(KEYS.lane("standard"), copy_fields)
    try:
        async with running_worker(redis_url, make_engine()) as worker:
            copy = Entry(EntryRef(KEYS.lane("standard"), copy_id.decode()), Lane.STANDARD, copy_fields, 5)
            await worker.intake._dead_letter_unadmittable(copy, RuntimeError("boom"))
            status = await client.hget(KEYS.job("held"), "status")
            dead = [fields for _, fields in await client.xrange(KEYS.dead)]
            replies = await client.xlen("held-replies")
    finally:
        await client.aclose()
    assert status == b"running" and replies == 0
    assert [(d[b"job_id"], d[b"entry_id"]) for d in dead] == [(b"held", copy_id)]


async def test_entries_delivered_to_this_worker_whose_read_never_returned_are_taken_at_once(
    redis_url: str, make_engine: Callable[..., Any]
) -> None:
    """Redis delivered an entry to this consumer, but the reply was lost (the process paused past its socket
    timeout, a dropped connection; here: an earlier process of the same worker name read it and died). The
    worker takes it when it next reads, not after a lease (a minute here)."""
    from scheduler.protocol.job import JobSpec
    from scheduler.protocol.keys import CONSUMER_GROUP
    from tests.harness.worker_harness import xadd_job

    client = aioredis.Redis.from_url(redis_url)
    lane = KEYS.lane("standard")
    await client.xgroup_create(lane, CONSUMER_GROUP, id="0", mkstream=True)
    await xadd_job(client, JobSpec(id="lost-reply", prompt="hi", params=SamplingParams(max_tokens=3)))
    await client.xreadgroup(CONSUMER_GROUP, "w-fixed", {lane: ">"}, count=1)  # delivered, never admitted
    try:
        async with running_worker(redis_url, make_engine(), worker_name="w-fixed", lease_s=60.0):
            # Within 50 s: a lease of 60 would give the entry to no one before then.
            views = await wait_terminal(client, ["lost-reply"], timeout_s=50)
    finally:
        await client.aclose()
    assert views["lost-reply"]["status"] == "succeeded" and views["lost-reply"]["attempts"] == 1
