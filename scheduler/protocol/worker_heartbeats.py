"""The workers' heartbeats (``keys.workers``): the one reader of them, for the gateway and the workers.

A worker writes its heartbeat (msgpack: ``time``, ``model``, ``running``, ``capacity``, ``max_model_len``,
``vocab_size``, …) every ``--heartbeat-interval-s`` and deletes it when it stops cleanly; a worker that is
killed leaves its entry behind. So an entry is live while its ``time`` is within the gateway's
``--model-heartbeat-max-age-s``; an older one is of a worker that is gone. The same age decides which workers
``/readyz`` shows (it also removes the older entries), which models ``GET /v1/models`` lists and which
workers' context length and vocabulary bound what the gateway admits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError

from scheduler.protocol.redis_client import is_out_of_memory
from scheduler.protocol.redis_replies import read_hash


DEFAULT_HEARTBEAT_MAX_AGE_S = 30.0
"""How old a heartbeat may be for its worker to count as alive (the gateway's `--model-heartbeat-max-age-s`)."""


async def recent_heartbeats(redis: aioredis.Redis, key: str, *, max_age_s: float, now: float,
                            besides: str | None = None) -> list[dict[str, Any]]:
    """The heartbeats written at most `max_age_s` before `now`, but worker `besides`'s (a worker asking about the
    others, whose own last run under its name may have left a beat); one this process cannot read, or without a
    time, says nothing it can use and is left out."""
    return [beat for name, beat in (await _recent(redis, key, max_age_s, now)).items() if name != besides]


@dataclass(frozen=True)
class BeatTime:
    """When a worker's heartbeat was written (by its own clock), and how often it writes one."""

    time: float
    interval_s: float | None
    """None for a worker that does not say (an older one)."""


async def heartbeat_time(redis: aioredis.Redis, key: str, name: str) -> BeatTime | None:
    """Worker `name`'s heartbeat's time and interval; None where it has none this process can read."""
    raw = await redis.hget(key, name)
    beat = None if raw is None else _decoded(raw if isinstance(raw, bytes) else raw.encode())
    if not isinstance(beat, dict) or (at := _time_of(beat)) is None:
        return None
    interval = beat.get("heartbeat_interval_s")
    if isinstance(interval, (int, float)) and not isinstance(interval, bool) and interval > 0:
        return BeatTime(at, float(interval))
    return BeatTime(at, None)


async def recent_workers(redis: aioredis.Redis, key: str, *, max_age_s: float, now: float) -> set[str]:
    """The names of the workers whose heartbeats are at most `max_age_s` old at `now` (read, not pruned)."""
    return set(await _recent(redis, key, max_age_s, now))


async def _recent(redis: aioredis.Redis, key: str, max_age_s: float, now: float) -> dict[str, dict[Any, Any]]:
    recent = {}
    for name, raw in (await read_hash(redis, key)).items():
        beat = _decoded(raw)
        if isinstance(beat, dict) and (at := _time_of(beat)) is not None and now - at <= max_age_s:
            recent[name.decode(errors="replace")] = beat
    return recent


async def live_workers(redis: aioredis.Redis, key: str, *, max_age_s: float, now: float) -> dict[str, Any]:
    """Worker name -> heartbeat, for heartbeats at most `max_age_s` old at `now`; prunes the older ones.

    An entry in a format this gateway cannot read is shown as None and left alone: it may be a newer
    worker's, and its age is unknown.
    """
    live: dict[str, Any] = {}
    stale: dict[bytes, bytes] = {}
    for name, raw in (await read_hash(redis, key)).items():
        beat = _decoded(raw)
        at = _time_of(beat) if isinstance(beat, dict) else None
        if at is not None and now - at > max_age_s:
            stale[name] = raw
        else:
            live[name.decode()] = None if beat is _UNREADABLE else beat
    if stale:
        try:
            await _prune(redis, key, stale)
        except (RedisError, OSError) as e:
            if not is_out_of_memory(e):
                raise
            # At maxmemory the reading goes on (readiness is about reads): the pruning waits for the next call.
    return live


_UNREADABLE = object()


def _decoded(raw: bytes) -> Any:
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:  # any malformed value: msgpack raises several types
        return _UNREADABLE


def _time_of(beat: dict[Any, Any]) -> float | None:
    at = beat.get("time")
    return float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else None


async def _prune(redis: aioredis.Redis, key: str, stale: dict[bytes, bytes]) -> None:
    """Delete the `stale` entries still holding the values read, unless any heartbeat is written meanwhile."""
    async with redis.pipeline(transaction=True) as pipe:
        try:
            await pipe.watch(key)
            current = await pipe.hmget(key, list(stale))
            unchanged = [name for name, value in zip(stale, current) if value == stale[name]]
            if unchanged:
                pipe.multi()  # type: ignore[no-untyped-call]  # redis-py leaves it without annotations
                pipe.hdel(key, *unchanged)
                await pipe.execute()
        except WatchError:
            pass  # a worker wrote its heartbeat between the read and the delete: the next read prunes again
