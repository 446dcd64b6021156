"""How every carpool process connects to Redis: connections that outlive a Redis restart.

A restarted Redis leaves each pooled connection's socket dead, and redis-py
finds out only when a command is sent on it: a worker that used a connection
before the restart and again a minute later lost that command (a job's
commit, which then ran again from its checkpoint; a dispatcher's settle,
which sent a webhook twice). So every client here checks a connection idle
for `HEALTH_CHECK_INTERVAL_S` with a PING before using it, and a command or
PING that finds its connection closed is sent once more on a fresh one.
Only connection errors are retried, not timeouts: a command that timed out
may have run, and sending it again could run it twice.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError

HEALTH_CHECK_INTERVAL_S = 10
"""A connection idle this long is PINGed before its next command."""


def connection_options() -> dict[str, Any]:
    """The options every client's pool takes (`from_url(url, **connection_options())`)."""
    return {
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    }


def connect(redis_url: str) -> aioredis.Redis:
    """A client of `redis_url` whose connections survive a Redis restart (replies as bytes, never decoded)."""
    return aioredis.Redis.from_url(redis_url, **connection_options())


def check_redis_url(redis_url: str) -> None:
    """Raise ``ValueError`` naming the problem when redis-py could not connect with ``redis_url`` as written."""
    try:
        parse_url(redis_url)  # type: ignore[no-untyped-call]  # redis-py leaves this one without annotations
    except ValueError as e:
        raise ValueError(f"redis_url: {e}, got {redacted_url(redis_url)!r}") from e


def redacted_url(redis_url: str) -> str:
    """``redis_url`` fit for a log line: its password, in the user part or a ``password=`` parameter, as ``***``."""
    try:
        parts = urlsplit(redis_url)
        password = parts.password
    except ValueError:
        return "<unparsable Redis URL>"
    redacted = redis_url
    if password:
        host = parts.netloc.rpartition("@")[2]
        redacted = redacted.replace(parts.netloc, f"{parts.username or ''}:***@{host}", 1)
    return re.sub(r"([?&]password=)[^&#]*", r"\1***", redacted)
