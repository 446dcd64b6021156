"""Server-sent events from a real gateway and worker: a client connecting late, or again with
Last-Event-ID, gets `started`, every token from index 0 without gaps or repeats, and `final`."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from tests.harness.worker_harness import KEYS, WAIT_S, running_worker, wait_terminal

Event = tuple[str, str, dict[str, Any]]
"""(SSE id, event type, data)."""


@pytest.fixture
def engine(tiny_model: Callable[..., str]) -> Any:
    from worker.engine.engine import Engine

    return Engine(model=tiny_model(), max_num_seqs=2)


async def _events(http: aiohttp.ClientSession, url: str, last_event_id: str | None = None,
                  limit: int | None = None) -> list[Event]:
    """The stream's events until `final` (or until `limit` events were read, then disconnect)."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    events: list[Event] = []
    async with http.get(url, headers=headers) as resp:
        assert resp.status == 200
        event_id, kind = "", ""
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append((event_id, kind, json.loads(line[6:])))
                if kind == "final" or (limit is not None and len(events) >= limit):
                    break
    return events


def _tokens(events: list[Event], start: int = 0) -> tuple[list[int], str]:
    """All token ids and text, checking each token event starts where the one before ended."""
    ids: list[int] = []
    text = ""
    for _, kind, data in events:
        if kind == "token":
            assert data["index"] == start + len(ids), (data["index"], start + len(ids))
            ids += data["token_ids"]
            text += data["text"]
    return ids, text


async def _submit(http: aiohttp.ClientSession, gateway_url: str, job_id: str, max_tokens: int) -> None:
    body = {"id": job_id, "prompt": "once upon a time",
            "params": {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}}
    async with http.post(f"{gateway_url}/v1/jobs", json=body) as resp:
        assert resp.status == 202


async def _checkpointed(client: aioredis.Redis, job_id: str, num_tokens: int = 16) -> None:
    from worker.job_store import unpack_checkpoint

    deadline = time.monotonic() + 60
    while len(unpack_checkpoint(await client.hget(KEYS.job(job_id), "checkpoint") or b"")[0]) < num_tokens:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


async def test_a_late_client_gets_the_whole_stream_and_can_resume(
    gateway_url: str, redis_url: str, engine: Any
) -> None:
    client = aioredis.Redis.from_url(redis_url)
    url = f"{gateway_url}/v1/jobs/late/events"
    try:
        async with running_worker(redis_url, engine, checkpoint_tokens=16), aiohttp.ClientSession() as http:
            await _submit(http, gateway_url, "late", 1900)
            await _checkpointed(client, "late")  # tokens were produced before anyone listened
            first = await _events(http, url, limit=4)  # started, the catch-up, then live tokens; then drop
            assert first[0][1] == "started" and first[0][2]["attempt"] == 1
            assert first[0][0] == "0.0.1"  # each id is the cursor after its own event, not after the catch-up
            assert first[1][0].startswith(f"{len(first[1][2]['token_ids'])}.")
            assert first[1][1] == "token" and first[1][2]["index"] == 0 and len(first[1][2]["token_ids"]) >= 16
            # While it runs, a cursor past what it has published, or of an attempt it has not reached, is none of
            # its own: the stream starts from the beginning, its ids counted from there.
            running_past = [await _events(http, url, last_event_id=cursor, limit=2)
                            for cursor in ("99999.99999.1", "0.0.7")]
            rest = await _events(http, url, last_event_id=first[-1][0])
            views = await wait_terminal(client, ["late"], timeout_s=120)
            after = await _events(http, url)  # the job has ended
            # After `final` there is nothing to resume: 204, which stops a browser's EventSource reconnecting.
            async with http.get(url, headers={"Last-Event-ID": rest[-1][0]}) as resp:
                after_final = (resp.status, await resp.read())
            # A cursor past the output, or one not of the form, starts from the beginning, consistently.
            made_up = [await _events(http, url, last_event_id=cursor)
                       for cursor in ("99999.0.1", "0.99999.1", "5_0.0.1", "1.2", "1.2.3.x")]
    finally:
        await client.aclose()
    assert after_final == (204, b"")
    assert rest[-1][0].endswith(".final") and not rest[-2][0].endswith(".final")
    for events in made_up:
        assert [kind for _, kind, _ in events] == ["started", "token", "final"], events
        assert events[1][2]["index"] == events[1][2]["text_index"] == 0
        assert [event_id for event_id, _, _ in events] == [event_id for event_id, _, _ in after], events
    for events in running_past:
        assert [(event_id, kind) for event_id, kind, _ in events][0] == ("0.0.1", "started"), events
        assert events[1][1] == "token" and events[1][2]["index"] == events[1][2]["text_index"] == 0, events
        assert events[1][0] == f"{len(events[1][2]['token_ids'])}.{len(events[1][2]['text'])}.1", events
    output = views["late"]["output"]
    assert [kind for _, kind, _ in rest].count("started") == 0 and rest[-1][1] == "final"
    first_ids, first_text = _tokens(first)
    rest_ids, rest_text = _tokens(rest, start=len(first_ids))
    assert first_ids + rest_ids == output["token_ids"]  # no gap, no repeat across the reconnect
    assert output["text"].startswith(first_text + rest_text)
    assert [kind for _, kind, _ in after] == ["started", "token", "final"]
    assert after[1][2]["index"] == 0 and after[1][2]["token_ids"] == output["token_ids"]
    assert after[1][2]["text"] == output["text"]


async def test_a_cursor_is_kept_when_a_running_jobs_event_log_is_gone(gateway_url: str, redis_url: str,
                                                                       engine: Any) -> None:
    """A running job's output is known only from its event log: with the log gone (expired while the job waited
    in a lane, say) the client's cursor cannot be judged, and is kept: the stream goes on after it, not again
    from the start (a cursor marked as having had its `final` too: the job has sent none), and a client without one
    still gets `started`, from the record."""
    client = aioredis.Redis.from_url(redis_url)
    url = f"{gateway_url}/v1/jobs/kept/events"
    try:
        async with running_worker(redis_url, engine, checkpoint_tokens=16), aiohttp.ClientSession() as http:
            await _submit(http, gateway_url, "kept", 1900)
            first = await _events(http, url, limit=3)
            await client.delete(KEYS.events_log("kept"))
            resumed = await _events(http, url, last_event_id=first[-1][0], limit=1)
            finished_early = await _events(http, url, last_event_id=f"{first[-1][0]}.final", limit=1)
            fresh = await _events(http, url, limit=2)
            await client.hset(KEYS.job("kept"), "status", "cancelled")  # ends the stream below at its next check
    finally:
        await client.aclose()
    end_of_first = len(_tokens(first)[0])
    [(_, kind, data)] = resumed
    assert kind == "token" and data["index"] >= end_of_first, (first[-1][0], resumed)
    [(event_id, kind, data)] = finished_early
    assert kind == "token" and data["index"] >= end_of_first and not event_id.endswith(".final"), finished_early
    assert [kind for _, kind, _ in fresh] == ["started", "token"] and fresh[0][0] == "0.0.1", fresh


async def test_head_on_an_event_stream_is_headers_only_and_the_connection_stays_usable(gateway_url: str) -> None:
    async with aiohttp.ClientSession() as http_session:
        async with http_session.post(f"{gateway_url}/v1/jobs", json={"prompt": "queued, no worker"}) as resp:
            job_id = (await resp.json())["id"]
    host, port = gateway_url.removeprefix("http://").rsplit(":", 1)

    def head_then_get() -> tuple[int, str, bytes, int]:
        conn = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
        conn.request("HEAD", f"/v1/jobs/{job_id}/events")
        head = conn.getresponse()
        head_body = head.read()
        conn.request("GET", "/healthz")  # the same connection: nothing of the stream may be left on it
        health = conn.getresponse()
        health.read()
        conn.close()
        return head.status, head.getheader("Content-Type") or "", head_body, health.status

    status, content_type, body, health_status = await asyncio.to_thread(head_then_get)
    assert (status, body, health_status) == (200, b"", 200)
    assert content_type.startswith("text/event-stream")


async def test_a_stream_whose_job_record_vanishes_ends_with_an_error_event(redis_url: str) -> None:
    """Deleted, or lost by a Redis restart without persistence, while the client waits: an `error` event says so,
    and the stream ends rather than stopping without a word."""
    from gateway.app import init_app
    from gateway.config import GatewayConfig
    from tests.harness.gateway_server import GatewayTestServer

    client = aioredis.Redis.from_url(redis_url)
    server = GatewayTestServer(init_app(GatewayConfig(redis_url=redis_url, no_webhooks=True, sse_heartbeat_s=0.2)))
    async with server, aiohttp.ClientSession() as http:
        await _submit(http, str(server.make_url("")).rstrip("/"), "vanishing", 4)  # no worker: it waits

        async def delete_soon() -> None:
            await asyncio.sleep(0.5)
            await client.delete(KEYS.job("vanishing"))

        deleting = asyncio.create_task(delete_soon())
        events = await asyncio.wait_for(_events(http, str(server.make_url("/v1/jobs/vanishing/events"))), WAIT_S)
        await deleting
    await client.aclose()
    assert [kind for _, kind, _ in events] == ["error"]
    assert events[0][2]["error"]["type"] == "not_found" and "record is gone" in events[0][2]["error"]["message"]


def test_a_cursor_for_a_job_that_has_not_started_must_be_at_its_start() -> None:
    """A queued job has published nothing: a cursor past its start is another job's (an earlier one under its id),
    and would otherwise skip the tokens it is yet to publish."""
    from gateway.sse import Cursor, _extent

    queued = {"id": "q", "status": "queued", "attempts": 0, "started_at": None, "output": None}
    assert not Cursor.parse("5.10.0").fits(_extent(queued, [], has_ended=False))
    assert Cursor.parse("0.0.0").fits(_extent(queued, [], has_ended=False))
    started = {**queued, "status": "running", "attempts": 1, "started_at": 1.0}  # its log gone: not known
    assert Cursor.parse("5.10.1").fits(_extent(started, [], has_ended=False))


def test_a_catch_up_says_started_from_the_record_only_where_the_log_holds_none() -> None:
    """Attempt 2 counted in the record before its `started` is published, attempt 1's log still there: the catch-up
    is attempt 1's events in their order (attempt 2's `started` comes live), not a second `started` ahead of them."""
    from gateway.sse import Cursor, catch_up

    view = {"id": "j", "status": "running", "attempts": 2, "started_at": 1.0, "worker": "w", "output": None}
    logged = [{"type": "started", "id": "j", "attempt": 1, "attempts": 1},
              {"type": "token", "id": "j", "index": 0, "token_ids": [7, 8], "text": "ab", "text_index": 0}]
    events = catch_up(view, logged, Cursor())
    assert [(e["type"], e.get("attempt")) for e in events] == [("started", 1), ("token", None)], events
    without_log = catch_up(view, [], Cursor())
    assert [(e["type"], e["attempt"]) for e in without_log] == [("started", 2)], without_log
