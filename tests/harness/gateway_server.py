"""The gateway app on a test server that treats a client's hang-up as `carpool gateway` does.

aiohttp's `TestServer` cancels a request's handler when the client disconnects; `web.run_app` and
`web.AppRunner`, which serve the gateway, do not (their `handler_cancellation` is off). A test served by
`TestServer` would see a hang-up's cancellation that production never gets, and could not catch a handler
that misses the hang-up, so the gateway's tests run on this server instead.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer


class GatewayTestServer(TestServer):
    async def _make_runner(self, **kwargs: Any) -> web.BaseRunner:
        kwargs["handler_cancellation"] = False
        return web.AppRunner(self.app, **kwargs)
