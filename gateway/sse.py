"""`GET /v1/jobs/{id}/events`: a job's events from its start, whenever the client connects.

Live events come from the job's pub/sub channel (through the `EventHub`); what came before the
client connected comes from the job's event log (`Keys.events_log`, written by the worker beside
each publish) while it runs, and from the record once it has ended. Either way the client gets
`started`, every token from index 0 (earlier ones coalesced into one `token` event), then live
tokens and `final`. Each event's SSE `id` is a cursor, `TOKENS.TEXT_CHARS.ATTEMPT` (tokens and text
sent so far, the last `started` attempt sent), and `final`'s ends in `.final`: sent back as
`Last-Event-ID`, the stream resumes after it, with no gap and no repeat; after `final` there is nothing
left, and the answer is `204` (which tells an `EventSource` to stop reconnecting). A job resumed on another worker re-runs from its checkpoint,
repeating tokens (placed by `index`) and text (placed by `text_index`) already sent: each token
and each character goes out once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

import msgpack
import redis.asyncio as aioredis
from aiohttp import web

from gateway.access_log import client_gone, note_client_gone
from gateway.event_hub import EventHub, is_terminal
from scheduler.protocol.job_record import EventType, final_event, job_view, json_default
from scheduler.protocol.keys import Keys
from scheduler.protocol.redis_replies import read_hash


FINAL_MARK = "final"
"""The last part of the id of a `final` event."""
_DIGITS = re.compile(r"[0-9]{1,18}")


@dataclass(frozen=True)
class Extent:
    """How far a job has got: tokens and text characters published (None: not known, no bound), and attempts."""

    tokens: int | None
    text_chars: int | None
    attempts: int


@dataclass
class Cursor:
    """How far the client has got: tokens and text characters sent, and the last attempt it saw start."""

    tokens: int = 0
    text_chars: int = 0
    attempt: int = 0
    has_final: bool = False
    """The client has had the `final` event of `attempt`."""

    @classmethod
    def parse(cls, last_event_id: str | None) -> Cursor:
        parts = (last_event_id or "").strip().split(".")
        has_final = len(parts) == 4 and parts[3] == FINAL_MARK
        if has_final:
            parts = parts[:3]
        if len(parts) != 3 or not all(_DIGITS.fullmatch(part) for part in parts):
            return cls()  # none, or not one of ours: from the start
        tokens, text_chars, attempt = (int(part) for part in parts)
        return cls(tokens, text_chars, attempt, has_final)

    def fits(self, extent: Extent) -> bool:
        """Whether this cursor can be the job's, given how far it has got: one past that is none of this job's
        (made up, or another job's under the same id), and the stream starts over from the beginning."""
        return ((extent.tokens is None or self.tokens <= extent.tokens)
                and (extent.text_chars is None or self.text_chars <= extent.text_chars)
                and self.attempt <= extent.attempts)

    def __str__(self) -> str:
        return f"{self.tokens}.{self.text_chars}.{self.attempt}" + (f".{FINAL_MARK}" if self.has_final else "")

    def advance(self, event: dict[str, Any]) -> None:
        """Move past one event as sent (``take`` has made it new to the client)."""
        if event.get("type") == EventType.FINAL:
            self.has_final = True
            self.attempt = max(self.attempt, int(event.get("attempt") or 0))
        elif event.get("type") == EventType.STARTED:
            self.attempt = max(self.attempt, int(event.get("attempt") or event.get("attempts") or 1))
        elif event.get("type") == EventType.TOKEN:
            self.tokens = int(event["index"]) + len(event["token_ids"])
            self.text_chars += len(event["text"])

    def take(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """The part of a live or logged event the client has not had yet (None: nothing new)."""
        if event.get("type") == EventType.STARTED:
            attempt = int(event.get("attempt") or event.get("attempts") or 0)
            if not attempt:
                self.attempt = max(self.attempt, 1)  # a publisher that numbers no attempts: count it the first
                return event
            if attempt <= self.attempt:
                return None
            self.attempt = attempt
            return event
        if event.get("type") != EventType.TOKEN:
            return event
        ids, index, text = list(event.get("token_ids") or []), int(event.get("index", 0)), str(event.get("text") or "")
        text_index = event.get("text_index")
        if index < self.tokens:
            ids, index = ids[self.tokens - index:], self.tokens  # sent already, or a resumed run repeating them
        if isinstance(text_index, int) and not isinstance(text_index, bool):
            # Text is placed by its own offset: a resumed run's first event repeats the text from the start.
            text = text[max(0, self.text_chars - text_index):]
        elif not ids:
            text = ""  # a publisher without text offsets: the text rides with its tokens
        if not ids and not text:
            return None
        self.tokens = index + len(ids)
        taken = {**event, "index": index, "token_ids": ids, "text": text, "text_index": self.text_chars}
        self.text_chars += len(text)
        return taken

    def is_behind(self, event: dict[str, Any]) -> bool:
        """Whether a token event starts past what was taken (events in between were lost: read the log)."""
        text_index = event.get("text_index")
        return int(event.get("index", 0)) > self.tokens or (isinstance(text_index, int)
                                                            and text_index > self.text_chars)


def coalesce(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive contiguous token events merged into one (what was produced before the client came)."""
    out: list[dict[str, Any]] = []
    for event in events:
        last = out[-1] if out else None
        if (last is not None and event["type"] == last["type"] == EventType.TOKEN
                and last["index"] + len(last["token_ids"]) == event["index"]):
            out[-1] = {**event, "index": last["index"], "token_ids": last["token_ids"] + event["token_ids"],
                       "text": last["text"] + event["text"], "text_index": last.get("text_index")}
        else:
            out.append(event)
    return out


def from_view(view: dict[str, Any], cursor: Cursor, final: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """An ended job's events the client has not had, from its record: started, the rest of its output, final."""
    events: list[dict[str, Any]] = []
    attempts = _attempts(view)
    if view.get("started_at") is not None and attempts > cursor.attempt:
        cursor.attempt = attempts
        events.append(_started(view, attempts))
    output = view.get("output") or {}
    ids, text = list(output.get("token_ids") or [])[cursor.tokens:], (output.get("text") or "")[cursor.text_chars:]
    if ids or text:
        events.append({"type": EventType.TOKEN, "id": view["id"], "index": cursor.tokens, "token_ids": ids, "text": text,
                       "text_index": cursor.text_chars, "attempt": attempts})
        cursor.tokens += len(ids)
        cursor.text_chars += len(text)
    events.append(final or final_event(view["id"], view, attempts))
    return events


def _attempts(view: dict[str, Any]) -> int:
    """The record's attempts; one at least for a record that ran (it was started once)."""
    attempts = int(view.get("attempts") or 0)
    return max(1, attempts) if view.get("started_at") is not None else attempts


def _extent(view: dict[str, Any], logged: list[dict[str, Any]], *, has_ended: bool) -> Extent:
    """How far a job has got, as its record and logged events tell. A job that has not ended keeps its output
    in its event log alone: with none, one that has started (its log expired while it waited, say) has got to
    where it is not known, one that has not, nowhere."""
    if not has_ended and not logged and view.get("started_at") is not None:
        return Extent(None, None, _attempts(view))
    output = view.get("output") or {}
    tokens, text_chars, attempts = len(output.get("token_ids") or []), len(output.get("text") or ""), _attempts(view)
    for event in logged:
        if event.get("type") == EventType.TOKEN:
            tokens = max(tokens, int(event.get("index", 0)) + len(event.get("token_ids") or []))
            text_index = event.get("text_index")
            if isinstance(text_index, int) and not isinstance(text_index, bool):
                text_chars = max(text_chars, text_index + len(str(event.get("text") or "")))
        elif event.get("type") == EventType.STARTED:
            attempts = max(attempts, int(event.get("attempt") or event.get("attempts") or 1))
    return Extent(tokens, text_chars, attempts)


def _started(view: dict[str, Any], attempts: int) -> dict[str, Any]:
    return {"type": EventType.STARTED, "id": view["id"], "worker": view.get("worker"), "attempts": attempts,
            "attempt": attempts, "resumed_from": view.get("resumed_from")}


async def read_log(redis: aioredis.Redis, keys: Keys, job_id: str) -> list[dict[str, Any]]:
    """The job's logged events, as published."""
    events = []
    for _, fields in await redis.xrange(keys.events_log(job_id)) or []:
        raw = (fields or {}).get(b"e")
        event = msgpack.unpackb(raw, raw=False, strict_map_key=False) if raw else None
        if isinstance(event, dict):
            events.append(event)
    return events


def take_logged(logged: list[dict[str, Any]], cursor: Cursor) -> list[dict[str, Any]]:
    """What of the logged events the client has not had, coalesced."""
    return coalesce([taken for event in logged if (taken := cursor.take(event)) is not None])


def catch_up(view: dict[str, Any], logged: list[dict[str, Any]], cursor: Cursor) -> list[dict[str, Any]]:
    """What a running job has published that the client has not had: the logged events, and its `started` said
    from the record where the log holds none (gone: expired while the job waited). A log that holds an earlier
    attempt's `started` holds the next one's too, or it comes live."""
    events = take_logged(logged, cursor)
    has_logged_start = any(event.get("type") == EventType.STARTED for event in logged)
    if view.get("started_at") is not None and cursor.attempt < _attempts(view) and not has_logged_start:
        cursor.attempt = _attempts(view)
        events.insert(0, _started(view, cursor.attempt))
    return events


async def logged_events(redis: aioredis.Redis, keys: Keys, job_id: str, cursor: Cursor) -> list[dict[str, Any]]:
    return take_logged(await read_log(redis, keys, job_id), cursor)


CLIENT_CHECK_S = 1.0
"""How often a request waiting with nothing to send looks whether its client is still there."""


async def stream_events(request: web.Request, response: web.StreamResponse, redis: aioredis.Redis, keys: Keys,
                        hub: EventHub, job_id: str, heartbeat_s: float) -> None:
    """Write the job's events to ``response`` (prepared here) until ``final``."""
    # Subscribed before anything is read: an event published after a read is never missed.
    async with hub.subscribe(keys.events(job_id)) as sub:
        record = await read_hash(redis, keys.job(job_id))
        view, has_ended = (job_view(record) if record else {}), is_terminal(record)
        logged = await read_log(redis, keys, job_id)
        claimed = Cursor.parse(request.headers.get("Last-Event-ID"))
        if not claimed.fits(_extent(view, logged, has_ended=has_ended)):
            claimed = Cursor()
        elif claimed.has_final and not has_ended:
            claimed.has_final = False  # no `final` was sent of a job that has not ended: another's under its id
        cursor = dataclasses.replace(claimed)
        """What has been taken to send (catch-up is read ahead of sending)."""
        sent = dataclasses.replace(claimed)
        """What the client has had once each event is out: its SSE id."""

        async def send(events: list[dict[str, Any]]) -> None:
            for event in events:
                sent.advance(event)
                data = json.dumps(event, separators=(",", ":"), default=json_default)
                await response.write(f"id: {sent}\nevent: {event['type']}\ndata: {data}\n\n".encode())

        if has_ended and sent.has_final and sent.attempt == _attempts(view):
            response.set_status(204)  # the client has had everything, `final` included: nothing to reconnect for
            await response.prepare(request)
            return
        await response.prepare(request)
        if request.method == "HEAD":
            return  # the headers alone: a body after them would be read as the next response on the connection
        if has_ended:
            await send(from_view(view, cursor))
            return
        await send(catch_up(view, logged, cursor))
        loop = asyncio.get_running_loop()
        last_write = loop.time()
        while True:
            try:
                event = await asyncio.wait_for(sub.queue.get(), min(heartbeat_s, CLIENT_CHECK_S))
            except TimeoutError:
                if client_gone(request):
                    note_client_gone(request)
                    return  # gone while the job waits: no keep-alive needed to find out
                if loop.time() - last_write < heartbeat_s:
                    continue
                last_write = loop.time()
                await response.write(b": keep-alive\n\n")
                # A final event lost to a dropped connection must not leave the stream open forever.
                record = await read_hash(redis, keys.job(job_id))
                if not record:
                    # Deleted, expired, or lost by Redis (a restart without persistence): said, not a silent end.
                    await send([{"type": "error", "id": job_id, "error": {
                        "type": "not_found", "message": "the job's record is gone (deleted, expired, or lost by "
                                                        "Redis); no more events will come"}}])
                    return
                if is_terminal(record):
                    await send(from_view(job_view(record), cursor))
                    return
                continue
            if event["type"] == "closed":
                return
            if event["type"] == EventType.FINAL:
                await send(from_view(event["job"], cursor, final=event))
                return
            if event["type"] == EventType.TOKEN and cursor.is_behind(event):
                await send(await logged_events(redis, keys, job_id, cursor))  # fill a gap (a slow reader's drops)
            taken = cursor.take(event)
            if taken is not None:
                await send([taken])
                last_write = loop.time()
