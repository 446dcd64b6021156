"""Streaming answers in OpenAI's chunk format: ``data: {chunk}`` lines, then ``data: [DONE]``.

Text deltas come from the jobs' token events, each choice's placed by a
`gateway.sse.Cursor`: a job resumed on another worker re-runs from its
checkpoint and repeats tokens and text already sent, and each character goes
out once; events a slow reader lost are read back from the job's event log,
and a choice's final record carries whatever is still missing. The response
starts with the first token (or after ``--sse-heartbeat-s`` of waiting), also
when that token's text is held back because it is part of a character (chat's
first chunks, naming the role, then mark the first token), so a
request the worker refuses before any token (a prompt too long for the
context) is answered with a 4xx in OpenAI's error shape, as without
streaming. Every second without an event the stream checks its client: one
that has gone gets its jobs cancelled (no compute is left orphaned).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from aiohttp import web

from gateway import appkeys
from gateway.access_log import client_gone, note_client_gone
from gateway.auth import RATE_HEADERS
from gateway.errors import REDIS_UNAVAILABLE
from gateway.errors import OpenAIError
from gateway.openai import responses
from gateway.openai.choices import ChoiceWatch, cancel_jobs
from gateway.openai.schema import Endpoint, OpenAIRequest
from gateway.sse import CLIENT_CHECK_S, Cursor, from_view, logged_events
from scheduler.protocol.job_record import EventType
from scheduler.protocol.redis_replies import REDIS_UNAVAILABLE

log = logging.getLogger(__name__)


class ClientGone(Exception):
    pass


class _Chunks:
    """The SSE response, started on first use (chat's first chunk per choice names the role)."""

    def __init__(self, request: web.Request, req: OpenAIRequest, request_id: str, created: int,
                 num_choices: int) -> None:
        self._request, self._req = request, req
        self._request_id, self._created, self._num_choices = request_id, created, num_choices
        self.response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
            **request.get(RATE_HEADERS, {}),
        })

    @property
    def is_open(self) -> bool:
        return self.response.prepared

    async def open(self) -> None:
        if self.is_open:
            return
        await self.response.prepare(self._request)
        if self._req.endpoint is Endpoint.CHAT:
            for index in range(self._num_choices):
                await self.send(self.chunk(index, role="assistant"))

    def chunk(self, index: int, *, text: str = "", role: str | None = None,
              finish: str | None = None) -> dict[str, Any]:
        return responses.chunk(self._req.endpoint, self._request_id, self._created, self._req.model, index,
                               text=text, role=role, finish=finish, include_usage=self._req.include_usage)

    async def send(self, data: dict[str, Any] | str) -> None:
        await self.open()
        text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        await self._write(f"data: {text}\n\n".encode())

    async def keep_alive(self) -> None:
        await self.open()
        await self._write(b": keep-alive\n\n")

    async def _write(self, data: bytes) -> None:
        try:
            await self.response.write(data)
        except ConnectionResetError as e:
            raise ClientGone from e


async def stream_choices(request: web.Request, req: OpenAIRequest, watch: ChoiceWatch, request_id: str,
                         created: int) -> web.StreamResponse:
    """Send the enqueued choices' chunks as they come; the caller cancels whatever is left after."""
    app = request.app
    redis, keys = app[appkeys.REDIS], app[appkeys.KEYS]
    num_choices = len(watch.job_ids)
    out = _Chunks(request, req, request_id, created, num_choices)
    cursors = [Cursor() for _ in range(num_choices)]
    views: dict[int, dict[str, Any]] = {}

    async def finish(index: int, view: dict[str, Any]) -> bool:
        """Send a choice's last text and finish chunk; False (after an error chunk) when its job failed."""
        views[index] = view
        if view.get("status") != "succeeded":
            error = responses.job_error(view, req.renames)
            if not out.is_open:
                raise error
            await out.send({"error": {"message": error.message, "type": "server_error" if error.status >= 500
                                      else "invalid_request_error", "param": error.param, "code": error.code}})
            return False
        for event in from_view(view, cursors[index]):
            if event["type"] == "token" and event["text"]:
                await out.send(out.chunk(index, text=event["text"]))
        await out.send(out.chunk(index, finish=responses.finish_reason(view)))
        return True

    try:
        heartbeat_s = app[appkeys.CONFIG].sse_heartbeat_s
        last_beat = time.monotonic()
        while len(views) < num_choices:
            got = await watch.next(CLIENT_CHECK_S)
            if got is None:
                if client_gone(request):
                    raise ClientGone
                now = time.monotonic()
                if now - last_beat >= heartbeat_s:
                    last_beat = now
                    await out.keep_alive()
                    pending = [i for i in range(num_choices) if i not in views]
                    for index, view in (await watch.terminal_views(pending)).items():
                        if not await finish(index, view):
                            return out.response
                continue
            index, event = got
            if index in views:
                continue
            if event["type"] == "closed":
                if not out.is_open:
                    raise OpenAIError(503, "the server is shutting down; retry", code="shutting_down")
                await out.send({"error": {"message": "the server is shutting down", "type": "server_error",
                                          "param": None, "code": "shutting_down"}})
                return out.response
            if event["type"] == "token":
                cursor = cursors[index]
                taken = []
                if cursor.is_behind(event):  # events in between were lost: the job's log has them
                    taken += await logged_events(redis, keys, watch.job_ids[index], cursor)
                if (one := cursor.take(event)) is not None:
                    taken.append(one)
                # The log holds the job's `started` events too (this stream reads them nowhere else): text only.
                text = "".join(e["text"] for e in taken if e.get("type") == EventType.TOKEN)
                if text:
                    await out.send(out.chunk(index, text=text))
                elif not out.is_open:
                    await out.open()  # the first token, its text held back (part of a character): the stream starts
            elif event["type"] == "final":
                if not await finish(index, event["job"]):
                    return out.response
        if req.include_usage:
            await out.send(responses.usage_chunk(req.endpoint, request_id, created, req.model,
                                                 [views[i] for i in range(num_choices)]))
        await out.send("[DONE]")
    except ClientGone:
        note_client_gone(request)
        log.info("stream %s: client went away; cancelling its jobs", request_id)
        await cancel_jobs(app, watch.job_ids)
    except REDIS_UNAVAILABLE as e:
        if not out.is_open:
            raise
        log.warning("stream %s: ended early, Redis unavailable: %s", request_id, e)
    return out.response
