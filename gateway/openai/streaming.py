"""Streaming answers in OpenAI's chunk format: ``data: {chunk}`` lines, then ``data: [DONE]``.

Text deltas come from the jobs' token events; a choice's final event carries
its whole text, so whatever token events a slow reader lost is sent with the
finish chunk. Every second without an event the stream checks its client:
one that has gone gets its jobs cancelled (no compute is left orphaned).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from aiohttp import web

from gateway import appkeys as K
from gateway.auth import RATE_HEADERS
from gateway.openai import responses
from gateway.openai.choices import ChoiceWatch, cancel_jobs, client_gone
from gateway.openai.schema import Endpoint, OpenAIRequest
from gateway.errors import REDIS_UNAVAILABLE

log = logging.getLogger(__name__)

CLIENT_CHECK_S = 1.0


class ClientGone(Exception):
    pass


async def stream_choices(request: web.Request, req: OpenAIRequest, watch: ChoiceWatch, request_id: str,
                         created: int) -> web.StreamResponse:
    """Send the enqueued choices' chunks as they come; the caller cancels whatever is left after."""
    app = request.app
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
        **request.get(RATE_HEADERS, {}),
    })
    await response.prepare(request)
    endpoint, model = req.endpoint, req.model

    async def send(data: dict[str, Any] | str) -> None:
        text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        try:
            await response.write(f"data: {text}\n\n".encode())
        except ConnectionResetError as e:
            raise ClientGone from e

    sent_text = [""] * len(watch.job_ids)
    num_tokens = [0] * len(watch.job_ids)
    views: dict[int, dict[str, Any]] = {}
    try:
        if endpoint is Endpoint.CHAT:
            for index in range(len(watch.job_ids)):
                await send(responses.chunk(endpoint, request_id, created, model, index, role="assistant"))
        heartbeat_s = app[K.CONFIG].sse_heartbeat_s
        last_beat = time.monotonic()
        while len(views) < len(watch.job_ids):
            got = await watch.next(CLIENT_CHECK_S)
            if got is None:
                if client_gone(request):
                    raise ClientGone
                if time.monotonic() - last_beat >= heartbeat_s:
                    last_beat = time.monotonic()
                    try:
                        await response.write(b": keep-alive\n\n")
                    except ConnectionResetError as e:
                        raise ClientGone from e
                    pending = [i for i in range(len(watch.job_ids)) if i not in views]
                    for index, view in (await watch.terminal_views(pending)).items():
                        await _finish(send, req, request_id, created, index, view, sent_text, views)
                continue
            index, event = got
            if index in views:
                continue
            if event["type"] == "closed":
                await send({"error": {"message": "the server is shutting down", "type": "server_error",
                                      "param": None, "code": "shutting_down"}})
                return response
            if event["type"] == "token":
                ids = event.get("token_ids") or []
                start = event.get("index", num_tokens[index])
                if not isinstance(start, int) or start < num_tokens[index]:
                    continue  # a resumed job repeating tokens already sent
                num_tokens[index] = start + len(ids)
                text = event.get("text") or ""
                if text:
                    sent_text[index] += text
                    await send(responses.chunk(endpoint, request_id, created, model, index, text=text))
            elif event["type"] == "final":
                await _finish(send, req, request_id, created, index, event["job"], sent_text, views)
                if event["job"].get("status") != "succeeded":
                    return response
        if req.include_usage:
            await send(responses.usage_chunk(endpoint, request_id, created, model,
                                             [views[i] for i in range(len(views))]))
        await send("[DONE]")
    except ClientGone:
        log.info("stream %s: client went away; cancelling its jobs", request_id)
        await cancel_jobs(app, watch.job_ids)
    except REDIS_UNAVAILABLE as e:
        log.warning("stream %s: ended early, Redis unavailable: %s", request_id, e)
    return response


async def _finish(send: Any, req: OpenAIRequest, request_id: str, created: int, index: int,
                  view: dict[str, Any], sent_text: list[str], views: dict[int, dict[str, Any]]) -> None:
    views[index] = view
    if view.get("status") != "succeeded":
        error = responses.job_error(view)
        await send({"error": {"message": error.message, "type": "server_error" if error.status >= 500
                              else "invalid_request_error", "param": error.param, "code": error.code}})
        return
    text = (view.get("output") or {}).get("text", "")
    rest = text[len(sent_text[index]):] if text.startswith(sent_text[index]) else ""
    if rest:
        await send(responses.chunk(req.endpoint, request_id, created, req.model, index,
                                   text=rest))
    await send(responses.chunk(req.endpoint, request_id, created, req.model, index,
                               finish=responses.finish_reason(view)))
