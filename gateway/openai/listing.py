"""OpenAI's cursor pages over a creation-time index (a sorted set): ``?limit=N&after=ID&order=desc|asc``.

The index holds every tenant's ids, scored by creation time; a page keeps only the ids `load` answers (the
caller's own, still there, and matching the route's filters), reading the index 100 ids at a time until it
has ``limit`` of them and knows whether more follow. ``after`` must name an id in the index that the caller
may see, as OpenAI's lists take it: the last id of the page before; or one deleted since (a second sorted set
keeps deleted ids with their scores until they would have expired), so paging on from the last id of a page
still works after another client deleted that object.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, cast

import redis.asyncio as aioredis
from aiohttp import web

from gateway.errors import invalid

INDEX_PAGE = 100
"""Ids read from the index per round trip."""
ORDERS = ("desc", "asc")


async def cursor_page(request: web.Request, redis: aioredis.Redis, index_key: str,
                      load: Callable[[str], Awaitable[dict[str, Any] | None]],
                      may_name: Callable[[str], Awaitable[bool]], *, default_limit: int,
                      max_limit: int, deleted_key: str | None = None) -> dict[str, Any]:
    """One page of the list: ``{"object": "list", "data", "first_id", "last_id", "has_more"}``.

    `load` gives an id's object, or None to leave it out; `may_name` says whether ``after`` may name an id of the
    index (one whose object expired before the index dropped it is a place any caller may page on from);
    `deleted_key`: the deleted ids' sorted set, if the list has one."""
    query = request.query
    try:
        limit = int(query.get("limit", str(default_limit)))
    except ValueError as e:
        raise invalid("limit", "must be an integer") from e
    if not 1 <= limit <= max_limit:
        raise invalid("limit", f"must be within [1, {max_limit}]")
    order = query.get("order", "desc")
    if order not in ORDERS:
        raise invalid("order", f"must be one of {list(ORDERS)}")
    is_newest_first = order == "desc"
    start = 0
    if "after" in query:
        after = query["after"]
        rank = await (redis.zrevrank if is_newest_first else redis.zrank)(index_key, after)
        if rank is not None and await may_name(after):
            start = cast(int, rank) + 1
        elif rank is None and deleted_key is not None and (score := await redis.zscore(deleted_key, after)) is not None:
            # Deleted: the page goes on from the ids past its score (as many as lie before that, in this order).
            before = (f"({score}", "+inf") if is_newest_first else ("-inf", f"({score}")
            start = cast(int, await redis.zcount(index_key, *before))
        else:
            raise invalid("after", f"no such object: {after!r}")
    read = redis.zrevrange if is_newest_first else redis.zrange
    data: list[dict[str, Any]] = []
    has_more = False
    while not has_more:
        ids = [i.decode() for i in cast(list[bytes], await read(index_key, start, start + INDEX_PAGE - 1))]
        if not ids:
            break
        start += len(ids)
        for item_id in ids:
            view = await load(item_id)
            if view is None:
                continue
            if len(data) == limit:
                has_more = True
                break
            data.append(view)
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
