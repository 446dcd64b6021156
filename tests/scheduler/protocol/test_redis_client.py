"""carpool's Redis clients across a Redis restart: a pooled connection whose server went away is replaced,
once, instead of failing the command sent on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.cli.embedded_redis import EmbeddedRedis
from scheduler.protocol.redis_client import connect


async def _restart_between_commands(client: aioredis.Redis, server: EmbeddedRedis) -> bytes | None:
    await client.set("job", b"kept")  # the pool now holds a connection to the first server
    server.stop()
    server.start()  # same port and data directory: the append-only file brings the key back
    return await client.get("job")


async def test_a_command_after_a_redis_restart_goes_through(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "redis") as server:
        client = connect(server.url)
        try:
            assert await _restart_between_commands(client, server) == b"kept"
        finally:
            await client.aclose()


async def test_a_client_without_these_options_loses_that_command(tmp_path: Path) -> None:
    """The failure the options prevent, on the same server and steps."""
    with EmbeddedRedis(tmp_path / "redis") as server:
        client = aioredis.Redis.from_url(server.url)
        try:
            with pytest.raises(RedisConnectionError):
                await _restart_between_commands(client, server)
        finally:
            await client.aclose()
