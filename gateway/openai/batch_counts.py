"""How a batch's requests are counted: each once, as completed, failed, expired or dropped.

A request counts when its bit in the batch's settled bitmap is first set
(one script sets the bit and moves the batch hash's counters and token
usage), so counting again is harmless. Requests are counted from the batch's
results stream (their jobs' ``reply_to``) as they end, and by `scan`, which
reads the job records of the oldest uncounted requests, for whatever that
stream lost.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgpack
import redis.asyncio as aioredis
from redis.typing import EncodableT

from gateway.openai.batch_lines import LineError
from scheduler.protocol import state_machine
from scheduler.protocol.job_record import F_STATUS, F_USAGE
from scheduler.protocol.keys import Keys
from scheduler.protocol.redis_replies import as_bytes, stream_entries

SETTLE_WINDOW = 4000
"""Unsettled requests (from the oldest) whose job status one scan reads."""
RECORDS_PER_ROUND_TRIP = 100
"""Job records (or results) the batch driver reads in one Redis round trip. The driver shares the gateway's
event loop with every open stream, and parsing a record holds that loop 20–80 µs on a small CPU: a round
trip of 100 holds it about 10 ms, where reads of 1,000–4,000 held it for 100 ms and more, and every chat
completion streaming through the gateway meanwhile waited as long."""

Outcome = tuple[int, str] | tuple[int, str, dict[str, int]]
"""(line, outcome) or (line, outcome, the job's usage)."""
_OUTCOME_OF_STATUS = {"succeeded": "completed", "failed": "failed", "expired": "expired"}


class BatchCounts:
    def __init__(self, redis: aioredis.Redis, keys: Keys, ttl_s: int) -> None:
        self._redis, self._keys, self._ttl_s = redis, keys, ttl_s
        self._settle_script = redis.register_script(state_machine.BATCH_SETTLE)

    async def read_results(self, batch_id: str, is_cancelling: bool) -> None:
        """Settle the requests whose final record a worker (or a cancel) put on the batch's results stream.

        Entries are deleted once counted; counting is idempotent, so a driver that dies in between only
        counts them again as nothing.
        """
        stream = self._keys.batch_results(batch_id)
        prefix = f"{batch_id}-"
        while entries := [e for _, found in stream_entries(await self._redis.xread({stream: "0-0"},
                                                                                  count=RECORDS_PER_ROUND_TRIP))
                          for e in found]:
            outcomes: list[Outcome] = []
            for _, fields in entries:
                try:
                    record = msgpack.unpackb((fields or {})[b"result"], raw=False, strict_map_key=False)
                    number = int(str(record["id"]).removeprefix(prefix))
                    status = str(record["status"])
                except (KeyError, TypeError, ValueError, msgpack.UnpackException):
                    continue  # not a result of ours: the scan settles its request
                if (outcome := _outcome(number, status, _usage(record.get("usage")), is_cancelling)) is not None:
                    outcomes.append(outcome)
            await self.mark(batch_id, outcomes)
            await self._redis.xdel(stream, *[entry_id for entry_id, _ in entries])
            await self._redis.expire(stream, self._ttl_s)
            if len(entries) < RECORDS_PER_ROUND_TRIP:
                return

    async def scan(self, batch_id: str, b: dict[str, str], is_cancelling: bool) -> None:
        """Settle the finished requests among the oldest unsettled ones, and move the low-water mark.

        The results stream settles requests as they end; this reads their records too, now and then, for
        whatever that stream lost (a result trimmed from it, or a record that expired).
        """
        low, high = int(b["low"]), min(int(b["enqueued"]), int(b["low"]) + SETTLE_WINDOW)
        settled = await self.settled_bits(batch_id, low, high)
        pending = [low + i for i, is_settled in enumerate(settled) if not is_settled]
        still: list[int] = []
        for start in range(0, len(pending), RECORDS_PER_ROUND_TRIP):
            numbers = pending[start:start + RECORDS_PER_ROUND_TRIP]
            async with self._redis.pipeline(transaction=False) as pipe:
                for number in numbers:
                    pipe.hmget(self._keys.job(f"{batch_id}-{number}"), [F_STATUS, F_USAGE])
                replies = await pipe.execute()
            outcomes: list[Outcome] = []
            for number, (raw, raw_usage) in zip(numbers, replies):
                status = "failed" if raw is None else raw.decode()  # a record that expired counts as failed
                usage = _usage(msgpack.unpackb(raw_usage, raw=False) if raw_usage else None)
                if (outcome := _outcome(number, status, usage, is_cancelling)) is not None:
                    outcomes.append(outcome)
            await self.mark(batch_id, outcomes)
            done = {outcome[0] for outcome in outcomes}
            still += [n for n in numbers if n not in done]
        await self._redis.hset(self._keys.batch(batch_id), "low", still[0] if still else high)

    async def mark(self, batch_id: str, outcomes: Sequence[Outcome]) -> None:
        for start in range(0, len(outcomes), 1000):
            args: list[EncodableT] = []
            for outcome in outcomes[start:start + 1000]:
                usage = outcome[2] if len(outcome) == 3 else {}
                args += [outcome[0], outcome[1], usage.get("prompt_tokens", 0), usage.get("cached_tokens", 0),
                         usage.get("completion_tokens", 0)]
            await self._settle_script(keys=[self._keys.batch(batch_id), self._keys.batch_settled(batch_id)], args=args)

    async def mark_errors(self, batch_id: str, numbers: range | list[int], error: LineError) -> None:
        """Lines `numbers` failed, each with `error`."""
        if numbers:
            await self._redis.hset(self._keys.batch_errors(batch_id),
                                   mapping={k: v for n in numbers for k, v in error.fields(n).items()})
            await self.mark(batch_id, [(n, "failed") for n in numbers])

    async def settled_bits(self, batch_id: str, start: int, stop: int) -> list[bool]:
        """Bits [start, stop) of the settled bitmap (bit 0 is the high bit of byte 0, as Redis keeps them)."""
        if stop <= start:
            return []
        raw = as_bytes(await self._redis.getrange(self._keys.batch_settled(batch_id), start // 8, (stop - 1) // 8))
        return [bool(raw[(n // 8) - start // 8] & (0x80 >> (n % 8))) if (n // 8) - start // 8 < len(raw) else False
                for n in range(start, stop)]


def _outcome(number: int, status: str, usage: dict[str, int], is_cancelling: bool) -> Outcome | None:
    """How a request whose job is in `status` counts (None: not ended yet)."""
    if status == "cancelled":
        return number, "dropped" if is_cancelling else "failed"
    if status == "succeeded":
        return number, "completed", usage
    if status in _OUTCOME_OF_STATUS:
        return number, _OUTCOME_OF_STATUS[status]
    return None


def _usage(usage: object) -> dict[str, int]:
    """A finished job's token counts (none for a record without them)."""
    if not isinstance(usage, dict):
        return {}
    return {k: v for k, v in usage.items() if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)}
