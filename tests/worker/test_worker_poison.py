"""Poison entries: whatever a lane entry holds, it ends in a record or on the dead stream within
max_deliveries, the dead-letter path never fails on it, and the worker keeps serving."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter

import msgpack
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.params import SamplingParams
from scheduler.protocol.job import JobSpec
from scheduler.protocol.keys import CONSUMER_GROUP
from scheduler.protocol.lanes import Lane
from scheduler.telemetry.stream_stats import read_stream_counts
from tests.harness.worker_harness import KEYS, running_worker, wait_terminal, xadd_job

LANE = KEYS.lane(Lane.STANDARD)
DEPTH = 100_000


@pytest.fixture
def engine(tiny_model):
    from worker.engine.engine import Engine

    return Engine(model=tiny_model(), max_num_seqs=4)


def deep_msgpack_job(job_id: str) -> bytes:
    """A msgpack map whose metadata is a list nested DEPTH deep (msgpack.packb itself refuses to write one)."""
    head = msgpack.packb({"id": job_id, "prompt": "x"})
    return bytes([head[0] + 1]) + head[1:] + msgpack.packb("metadata") + b"\x91" * DEPTH + b"\xc0"


async def wait_settled(client: aioredis.Redis, num_dead: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        pending = (await client.xpending(LANE, CONSUMER_GROUP))["pending"]
        dead = await client.xlen(KEYS.dead)
        if pending == 0 and dead >= num_dead:
            return
        assert time.monotonic() < deadline, f"still {pending} pending, {dead} dead (want {num_dead})"
        await asyncio.sleep(0.1)


async def test_poison_entries_end_in_a_record_or_dead_and_the_worker_keeps_serving(redis_url: str, engine) -> None:
    client = aioredis.Redis.from_url(redis_url)
    await client.set(KEYS.job("squatted"), "a string where the job's hash would go")
    poison = {
        "deep-json": ('{"id": "deep-json", "prompt": "x", "metadata": ' + "[" * DEPTH + "]" * DEPTH + "}").encode(),
        "deep-msgpack": deep_msgpack_job("deep-msgpack"),
        "bytes-metadata": msgpack.packb({"id": "bytes-metadata", "prompt": "x", "metadata": {"blob": b"\x00\xff"},
                                         "webhook": {"url": "https://hooks.example/x"}}, use_bin_type=True),
        "surrogate-key": b'{"id": "surrogate-key", "prompt": "x", "\\ud800": 1}',
        # A msgpack map whose prompt is no UTF-8 (a producer that packs bytes as text): failed naming the field.
        "not-utf8": msgpack.packb({"id": "not-utf8", "prompt": "ab\udcffcd", "reply_to": "replies:not-utf8"},
                                  unicode_errors="surrogateescape"),
        # Its reply stream and trace no UTF-8: failed as well, with no reply stream a key could not be written to.
        "not-utf8-reply": msgpack.packb({"id": "not-utf8-reply", "prompt": "x", "reply_to": "replies:\udcff",
                                        "traceparent": "\udcff"}, unicode_errors="surrogateescape"),
        "squatted": msgpack.packb({"id": "squatted", "prompt": "x", "params": {"max_tokens": 2}}),
    }
    async with running_worker(redis_url, engine, lease_s=0.3, max_deliveries=2) as service:
        for raw in poison.values():
            await client.xadd(LANE, {"job": raw})
        await wait_settled(client, num_dead=len(poison), timeout_s=30)
        after = JobSpec(id="after", prompt="still serving", params=SamplingParams(max_tokens=3, temperature=0))
        await xadd_job(client, after)
        views = await wait_terminal(client, ["after", "bytes-metadata", "surrogate-key", "not-utf8", "not-utf8-reply"],
                                    timeout_s=30)
        assert not service.has_failed

    assert views["after"]["status"] == "succeeded"
    assert views["bytes-metadata"]["status"] == "failed"
    assert views["bytes-metadata"]["error"]["field"] == "metadata.blob"
    assert views["surrogate-key"]["status"] == "failed"
    assert views["not-utf8"]["status"] == "failed" and views["not-utf8"]["error"]["field"] == "prompt", views["not-utf8"]
    assert views["not-utf8-reply"]["status"] == "failed", views["not-utf8-reply"]
    assert views["not-utf8-reply"]["error"]["field"] in ("reply_to", "traceparent"), views["not-utf8-reply"]
    [(_, reply)] = await client.xrange("replies:not-utf8")  # its producer, waiting on its reply stream, hears of it
    assert msgpack.unpackb(reply[b"result"], raw=False)["status"] == "failed"
    dead = {fields[b"job"]: fields[b"reason"].decode() for _, fields in await client.xrange(KEYS.dead)}
    assert set(dead) == set(poison.values())
    assert "too deeply" in dead[poison["deep-json"]]
    assert await client.type(KEYS.job("squatted")) == b"string"  # a foreign key is left as it is
    # The one whose webhook could be read is answered there, failed, as its producer asked.
    deliveries = [(f[b"job_id"], f[b"event"]) for _, f in await client.xrange(KEYS.webhooks)]
    assert deliveries == [(b"bytes-metadata", b"completed")]
    await client.aclose()


TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=8) | st.sampled_from(["\ud800", "hi", ""])
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8)
JOB_FIELDS = ["id", "v", "prompt_token_ids", "messages", "lane", "priority", "deadline", "webhook", "reply_to",
              "metadata", "traceparent", "tenant"]
JOBS = st.builds(
    lambda good, odd: {**good, **odd},
    st.fixed_dictionaries({"id": st.uuids().map(str), "prompt": st.just("poison?"),
                           "params": st.fixed_dictionaries({"max_tokens": st.integers(min_value=1, max_value=3)})}),
    # A job that is valid but for one or two fields of any JSON (more would rarely pass the first check).
    st.dictionaries(st.sampled_from([*JOB_FIELDS, "prompt", "params"]), JSONISH, max_size=2))

def packed(job: dict[str, object]) -> bytes:
    """As a msgpack producer sends it, where msgpack can carry it (integers past 64 bits it cannot): else JSON."""
    try:
        return msgpack.packb(job, unicode_errors="surrogatepass")
    except OverflowError:
        return json.dumps(job).encode()


ENTRY_VALUES = st.binary(max_size=24) | JOBS.map(lambda job: json.dumps(job).encode()) | JOBS.map(packed)
ENTRIES = st.tuples(st.sampled_from(list(Lane)), st.builds(
    lambda job, more: {b"job": job, **more} if job is not None else more or {b"x": b""},
    st.none() | ENTRY_VALUES,
    st.dictionaries(st.sampled_from([b"routed_from", b"x"]) | st.binary(min_size=1, max_size=4), ENTRY_VALUES,
                    max_size=2)))


async def test_any_entry_a_producer_xadds_is_run_refused_or_dead_lettered_and_nothing_errs(
        redis_url: str, engine, caplog) -> None:
    """Entries drawn at random (any fields, any bytes, JSON and msgpack jobs with any values where a job's fields
    go), in every lane: each is taken off its lane's pending list, no worker task fails or logs an error, and a
    plain job after them runs."""
    drawn: list[tuple[Lane, dict[bytes, bytes]]] = []

    # Drawn the same way every run: a failure names entries that fail again (they are not asserted inside draw(),
    # so hypothesis cannot shrink or replay them).
    @settings(max_examples=120, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(entry=ENTRIES)
    def draw(entry: tuple[Lane, dict[bytes, bytes]]) -> None:
        drawn.append(entry)

    draw()
    client = aioredis.Redis.from_url(redis_url)
    with caplog.at_level(logging.WARNING):
        async with running_worker(redis_url, engine, max_deliveries=2) as service:
            for lane, fields in drawn:
                await client.xadd(KEYS.lane(lane), fields)
            deadline = time.monotonic() + 60
            # Every lane stream and the tenant streams a named tenant's entries are moved to: none left, twice
            # running (an entry moved to a new tenant's stream between the two reads of one count is missed once).
            empty = 0
            while empty < 2:
                snapshot = await read_stream_counts(client, KEYS)
                empty = 0 if sum(snapshot.depth.values()) else empty + 1
                assert time.monotonic() < deadline, f"entries still waiting or running: {snapshot}"
                await asyncio.sleep(0.1)
            after = JobSpec(id="after-random", prompt="still serving", params=SamplingParams(max_tokens=2))
            await xadd_job(client, after)
            views = await wait_terminal(client, ["after-random"], timeout_s=30)
            assert not service.has_failed
    # Each entry ends somewhere: on the dead stream (its job bytes, or its fields when it has no job), or as the
    # record of the job it names (run, failed, expired...; a second entry of one id is that job's too).
    dead = [fields for _, fields in await client.xrange(KEYS.dead)]
    dead_jobs = Counter(fields[b"job"] for fields in dead if b"job" in fields)  # one dead entry accounts for one
    unaccounted = []
    for lane, fields in drawn:
        raw = fields.get(b"job")
        if raw is None:
            continue
        if dead_jobs[raw]:
            dead_jobs[raw] -= 1
            continue
        job_id = _job_id(raw)
        if job_id is None or not await client.exists(KEYS.job(job_id)):
            unaccounted.append((lane, fields))
    await client.aclose()
    assert not unaccounted, unaccounted[:5]
    assert sum(b"job" not in fields for _, fields in drawn) == sum(b"job" not in fields for fields in dead)
    assert views["after-random"]["status"] == "succeeded"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


def _job_id(raw: bytes) -> str | None:
    """The id a lane entry's job bytes name, read as JSON or msgpack (None: neither, or no text id)."""
    for load in (json.loads, lambda data: msgpack.unpackb(data, strict_map_key=False)):
        try:
            job = load(raw)
        except Exception:
            continue
        return job.get("id") if isinstance(job, dict) and isinstance(job.get("id"), str) else None
    return None


async def test_an_entry_naming_its_fields_as_the_dead_streams_own_cannot_hide_carpools(redis_url: str,
                                                                                        engine) -> None:
    """The dead stream's `reason`, `stream`, `entry_id` and `worker` are carpool's, read raw or as a dict; the
    entry's own fields of those names are kept beside them as `entry.NAME`."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        async with running_worker(redis_url, engine):
            await client.xadd(LANE, {"reason": "all good", "stream": "fake", "worker": "me", "note": "kept"})
            await wait_settled(client, num_dead=1, timeout_s=30)
        [(_, dead)] = await client.xrange(KEYS.dead)
        raw = await client.eval("return redis.call('XRANGE', KEYS[1], '-', '+')", 1, KEYS.dead)  # unparsed
    finally:
        await client.aclose()
    assert dead[b"stream"] == LANE.encode() and dead[b"worker"] != b"me"
    assert b"job" in dead[b"reason"] and dead[b"reason"] != b"all good", dead
    assert (dead[b"entry.reason"], dead[b"entry.stream"], dead[b"entry.worker"], dead[b"note"]) == (
        b"all good", b"fake", b"me", b"kept")
    names = raw[0][1][::2]
    assert len(names) == len(set(names)), names  # no field twice in the entry itself


async def test_text_the_model_has_no_embedding_for_fails_its_job_and_the_worker_goes_on(redis_url, tiny_model) -> None:
    """A checkpoint whose tokenizer has more tokens than its model has embeddings (tokens added without resizing
    them): a prompt or chat whose text holds such a token fails that job, naming the fault; the engine never
    meets the id (it would fail the whole step, and the worker with it, at every delivery)."""
    from worker.engine.engine import Engine

    engine = Engine(model=tiny_model("llama", vocab_size=258, pad_token_id=None), max_num_seqs=2)  # 262 tokens
    client = aioredis.Redis.from_url(redis_url)
    params = SamplingParams(max_tokens=2, temperature=0)
    try:
        async with running_worker(redis_url, engine) as service:
            await xadd_job(client, JobSpec(id="text", prompt="hi <|im_end|>", params=params))
            await xadd_job(client, JobSpec(id="chat", messages=[{"role": "user", "content": "hi"}], params=params))
            await xadd_job(client, JobSpec(id="plain", prompt="hi", params=params))
            views = await wait_terminal(client, ["text", "chat", "plain"])
            assert not service.stopped.is_set()
    finally:
        await client.aclose()
    assert views["plain"]["status"] == "succeeded", views["plain"]
    for job_id, name in (("text", "prompt"), ("chat", "messages")):
        assert views[job_id]["status"] == "failed", views[job_id]
        message = views[job_id]["error"]["message"]
        assert message.startswith(f"{name}: the tokenizer made token id ") and "(0..257)" in message, message
