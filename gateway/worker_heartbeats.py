"""The workers' heartbeats (``keys.workers``) as ``/readyz`` shows them: only the live ones.

A worker writes its heartbeat (msgpack: ``time``, ``running``, ``capacity``, …) every
``--heartbeat-interval-s`` and deletes it when it stops cleanly; a worker that is killed leaves its
entry behind. So an entry is live while its ``time`` is within the gateway's
``--model-heartbeat-max-age-s`` (the age that also decides which models ``GET /v1/models`` lists);
an older one is of a worker that is gone, and is removed from the hash.
"""

from __future__ import annotations

from typing import Any

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import WatchError

from scheduler.protocol.redis_replies import read_hash


async def live_workers(redis: aioredis.Redis, key: str, *, max_age_s: float, now: float) -> dict[str, Any]:
    """Worker name -> heartbeat, for heartbeats at most `max_age_s` old at `now`; prunes the older ones.

    An entry in a format this gateway cannot read is shown as None and left alone: it may be a newer
    worker's, and its age is unknown.
    """
    live: dict[str, Any] = {}
    stale: dict[bytes, bytes] = {}
    for name, raw in (await read_hash(redis, key)).items():
        try:
            beat = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception:  # a heartbeat in an unknown format is still a worker we can name
            live[name.decode()] = None
            continue
        at = beat.get("time") if isinstance(beat, dict) else None
        if isinstance(at, (int, float)) and not isinstance(at, bool) and now - at > max_age_s:
            stale[name] = raw
        else:
            live[name.decode()] = beat
    if stale:
        await _prune(redis, key, stale)
    return live


async def _prune(redis: aioredis.Redis, key: str, stale: dict[bytes, bytes]) -> None:
    """Delete the `stale` entries still holding the values read, unless any heartbeat is written meanwhile."""
    async with redis.pipeline(transaction=True) as pipe:
        try:
            await pipe.watch(key)
            current = await pipe.hmget(key, list(stale))
            unchanged = [name for name, value in zip(stale, current) if value == stale[name]]
            if unchanged:
                pipe.multi()
                pipe.hdel(key, *unchanged)
                await pipe.execute()
        except WatchError:
            pass  # a worker wrote its heartbeat between the read and the delete: the next read prunes again
