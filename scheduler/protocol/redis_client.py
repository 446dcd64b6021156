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

A Redis that stops answering without closing its connections (a stopped or
stalled server, a network path that drops packets) is noticed by a timeout
rather than waited on forever: every read and connect ends after
`REDIS_TIMEOUT_S` (each process's ``--redis-timeout-s``) with a ``TimeoutError``, which each process treats like an
unreachable Redis (the gateway answers 503, the worker and the webhook
dispatcher retry). A client that blocks on purpose (the worker's
``XREADGROUP … BLOCK``) passes its longest block, which is added to the
timeout. What each process may repeat after a timeout, and why that is safe,
is in docs/guarantees.md ("Redis unavailable").
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
from redis.exceptions import AuthenticationError, NoPermissionError, OutOfMemoryError, RedisError, ResponseError

HEALTH_CHECK_INTERVAL_S = 10
"""A connection idle this long is PINGed before its next command."""

REDIS_TIMEOUT_S = 10.0
"""The default longest wait, in seconds, for a connection or for one reply (beyond a blocking command's own block
time). Well above what any carpool command or script takes, and above Redis's own 5 s script time limit."""

_OOM_REPLY = "OOM command not allowed"
"""How Redis at maxmemory refuses a write; a script's error carries it inside its own text."""


def connection_options(*, max_block_ms: int = 0, timeout_s: float = REDIS_TIMEOUT_S) -> dict[str, Any]:
    """The options every client's pool takes (`from_url(url, **connection_options())`).

    `max_block_ms`: the longest a command of this client blocks on purpose (``XREADGROUP … BLOCK``), so such a
    command is never taken for a Redis that stopped answering. `timeout_s`: the longest wait for a connection or
    a reply past that.
    """
    assert max_block_ms >= 0 and timeout_s > 0, (max_block_ms, timeout_s)
    return {
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        "socket_timeout": timeout_s + max_block_ms / 1000,
        "socket_connect_timeout": timeout_s,
    }


def connect(redis_url: str, *, max_block_ms: int = 0, timeout_s: float = REDIS_TIMEOUT_S) -> aioredis.Redis:
    """A client of `redis_url` whose connections survive a Redis restart and never wait on a silent Redis for
    ever (replies as bytes, never decoded); `max_block_ms` and `timeout_s` as in `connection_options`."""
    return aioredis.Redis.from_url(redis_url, **connection_options(max_block_ms=max_block_ms, timeout_s=timeout_s))


class RedisRefused(Exception):
    """Redis refuses this client for good: credentials it does not take, or an ACL user without a command carpool
    needs. No wait mends that, unlike an outage."""


_SCRIPT_ACL_REPLIES = ("can't run this command", "no permissions to run")
"""What Redis says of a command a script called and the user may not run (6.2, then 7's wording)."""
_NO_SUCH_DB_REPLY = "DB index is out of range"
"""What Redis says to the URL's database number past its `databases` (the client's SELECT when it connects)."""


def is_refusal(error: BaseException) -> bool:
    """Whether ``error`` is Redis refusing this client's credentials, its database number, or one of its commands
    (ACL), also one that a script called."""
    return isinstance(error, (AuthenticationError, NoPermissionError)) or (
        isinstance(error, ResponseError)
        and any(reply in str(error) for reply in (*_SCRIPT_ACL_REPLIES, _NO_SUCH_DB_REPLY)))


_NO_PASSWORD_REPLIES = ("NOAUTH", "Authentication required", "HELLO must be called with the client already authenticated")
"""What Redis says to a client that sent no password where one is needed: to a command, and to redis-py's HELLO
(whose own words point at HELLO's options, not at the missing password)."""


def refusal_reason(error: BaseException) -> str:
    """What a user should read of a refusal (`is_refusal`): a missing password, or a wrong user or password, said as
    such; any other refusal in Redis's own words."""
    text = str(error)
    if any(reply in text for reply in _NO_PASSWORD_REPLIES):
        return "Redis needs a password, and the URL has none (redis://:PASSWORD@HOST:PORT/DB, or USER:PASSWORD@)"
    if isinstance(error, AuthenticationError):
        return f"the URL's password, or its user, is wrong ({text})"
    return text


async def check_access(client: aioredis.Redis) -> None:
    """Raise `RedisRefused` when Redis refuses `client` outright: wrong credentials, or a user that may not run
    scripts (carpool's every change of a job is one). Unreachable, or at maxmemory, passes: that is waited out."""
    try:
        await client.ping()
        await client.script_load("return 1")
    except RedisError as e:
        if is_refusal(e):
            raise RedisRefused(refusal_reason(e)) from e
    except OSError:
        pass


async def ensure_group(client: aioredis.Redis, stream: str, group: str) -> bool:
    """Give `stream` the consumer group `group`, reading from its first entry (so entries XADDed before any
    reader are delivered too), making the stream where it is missing; False when the group was there already."""
    try:
        await client.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise
        return False
    return True


def is_wrong_type(error: BaseException) -> bool:
    """Whether ``error`` is Redis refusing a command on a key that holds another type (``WRONGTYPE``)."""
    return isinstance(error, ResponseError) and "WRONGTYPE" in str(error)  # inside a script's error too


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is Redis refusing a write because it is at its ``maxmemory`` (``noeviction``).

    A script is refused at its first write, so a refused script has written nothing.
    """
    return isinstance(error, OutOfMemoryError) or (isinstance(error, ResponseError) and _OOM_REPLY in str(error))


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
