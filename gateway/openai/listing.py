"""OpenAI's cursor pages over a creation-time index (a sorted set): ``?limit=N&after=ID&order=desc|asc``.

The index holds every tenant's ids, scored by creation time; a page keeps only the ids `load` answers (the
caller's own, still there, and matching the route's filters), reading the index 100 ids at a time until it
has ``limit`` of them and knows whether more follow. ``after`` must name an id still in the index that the
caller may name, as OpenAI's lists take it: the last id of the page before. A deleted object's id stays in
its index until it would have expired, so paging on from it still works after another client deleted it.
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
                      max_limit: int) -> dict[str, Any]:
    """One page of the list: ``{"object": "list", "data", "first_id", "last_id", "has_more"}``.

    `load` gives an id's object, or None to leave it out; `may_name` says whether ``after`` may name an id."""
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
        if rank is None or not await may_name(after):
            raise invalid("after", f"no such object: {after!r}")
        start = cast(int, rank) + 1
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
