"""A real aiohttp webhook receiver on 127.0.0.1 for the webhook tests.

Every request is verified with the reference `standardwebhooks` package.
`script` says how to answer the n-th request (status code, optional headers,
or None to never answer); after the script runs out it answers `then`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from standardwebhooks import Webhook, WebhookVerificationError


@dataclass
class Received:
    at: float
    headers: dict[str, str]
    body: bytes
    payload: Any
    status: int | None


@dataclass
class Answer:
    status: int | None  # None: hang until the client gives up
    headers: dict[str, str] = field(default_factory=dict)


class Receiver:
    def __init__(self, secret: str, script: list[Answer] | None = None, then: Answer | None = None) -> None:
        self.verifier = Webhook(secret)
        self.script = list(script or [])
        self.then = then or Answer(200)
        self.received: list[Received] = []
        self.bad_signatures = 0
        self.accepted = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def start(self) -> Receiver:
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = dict(request.headers)
        try:
            payload = self.verifier.verify(body, headers)
        except WebhookVerificationError:
            self.bad_signatures += 1
            return web.Response(status=401)
        answer = self.script.pop(0) if self.script else self.then
        self.received.append(Received(time.time(), headers, body, payload, answer.status))
        if answer.status is None:
            await asyncio.sleep(3600)
        if 200 <= (answer.status or 0) < 300:
            self.accepted.set()
        return web.Response(status=answer.status or 200, headers=answer.headers)

    def accepted_count(self) -> int:
        return sum(1 for r in self.received if r.status is not None and 200 <= r.status < 300)
