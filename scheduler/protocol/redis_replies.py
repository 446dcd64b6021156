"""Redis replies narrowed to the bytes carpool's clients receive.

redis-py annotates replies as ``bytes | str`` because its types cannot follow
``decode_responses``. carpool's clients never decode (job records hold msgpack),
so every reply is bytes: these helpers check that once, where a reply is read,
and hand the rest of the code plain ``bytes``.
"""

from __future__ import annotations

from collections.abc import Mapping

import redis.asyncio as aioredis
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import KeyT, XReadGroupResponse, XReadResponse

REDIS_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, OSError)
"""Redis unreachable, restarting, loading its data, or no pooled connection free within the pool timeout.

``OSError`` covers refused connections and ``TimeoutError`` (an ``OSError`` since Python 3.11)."""

StreamEntries = list[tuple[bytes, dict[bytes, bytes] | None]]
"""(entry id, fields) in stream order; fields are None for an entry deleted while pending."""


def as_bytes(reply: bytes | str) -> bytes:
    assert isinstance(reply, bytes), f"a carpool Redis client decoded a reply: {reply!r}"
    return reply


def as_optional_bytes(reply: bytes | str | None) -> bytes | None:
    """A reply that is nil when the key or field does not exist (GET, HGET)."""
    return None if reply is None else as_bytes(reply)


def bytes_hash(reply: Mapping[bytes | str, bytes | str]) -> dict[bytes, bytes]:
    return {as_bytes(field): as_bytes(value) for field, value in reply.items()}


async def read_hash(client: aioredis.Redis, key: KeyT) -> dict[bytes, bytes]:
    """HGETALL ``key``: empty when it does not exist."""
    return bytes_hash(await client.hgetall(key))


def stream_entries(reply: XReadResponse | XReadGroupResponse) -> list[tuple[bytes, StreamEntries]]:
    """XREAD or XREADGROUP's reply as (stream, entries) pairs; empty when the read timed out."""
    # The clients speak RESP2, where the reply is [[stream, [(id, fields), ...]], ...].
    assert isinstance(reply, list), f"XREAD over RESP2 answers a list, got {type(reply).__name__}"
    return [
        (as_bytes(stream), [(as_bytes(entry_id), None if fields is None else bytes_hash(fields))
                            for entry_id, fields in entries])
        for stream, entries in reply
    ]
