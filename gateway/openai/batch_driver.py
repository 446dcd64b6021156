"""Moves every active batch along, one round every ``--batch-poll-interval-s``.

All of a batch's progress lives in Redis (the batch hash's counters and
cursors, the settled bitmap, the job records), never in gateway memory, so a
restarted gateway — or another one — carries on where the last round stopped.
A short per-batch lock keeps two gateways from driving one batch at once;
every step is safe to repeat anyway (job ids are fixed per line, so a line
is never enqueued twice, and a line's request counts once, when its bit in
the settled bitmap is first set).

Request ``i`` (line ``i`` of the input file) runs as job ``{batch id}-{i}``
in the batch lane, with the batch's expiry as its ``deadline``: a request
not started by then never runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time

from aiohttp import web
from redis.typing import EncodableT, FieldT

from gateway import appkeys
from gateway.admission import InvalidJob, LaneFull
from gateway.api_keys import Caller
from gateway.cancel import AlreadyFinished, JobNotFound
from gateway.openai.batch_counts import RECORDS_PER_ROUND_TRIP, BatchCounts
from gateway.openai.batch_lines import (
    LineError,
    answer_field,
    custom_id_of,
    error_line,
    load_line,
    parse_line,
    result_line,
    unpack_error,
)
from gateway.openai.batches import COUNTERS, BatchStatus, batch_store
from gateway.openai.choices import model_choice
from gateway.openai.files import PAGE_LINES, file_store, is_blank
from gateway.openai.responses import CONTEXT_LENGTH_EXCEEDED, openai_param, renamed_in
from gateway.openai.schema import Endpoint
from scheduler.protocol import state_machine
from scheduler.protocol.job_record import job_view
from scheduler.protocol.redis_client import is_out_of_memory
from scheduler.protocol.redis_replies import REDIS_UNAVAILABLE, as_bytes
from scheduler.protocol.tenants import tenant_of
from scheduler.runtime.outage_log import OutageLog
from scheduler.runtime.tasks import raise_if_cancelled

log = logging.getLogger(__name__)

LOCK_S = 15
MAX_ENQUEUE_PER_ROUND = 2000
SCAN_INTERVAL_S = 10.0
"""Seconds between two scans of a batch's job records; its results stream counts requests in between."""
MAX_LISTED_ERRORS = 100
"""Line errors a batch that fails validation lists in its ``errors``; its error file holds every one."""
PARAM_OF_CODE = {"missing_custom_id": "custom_id", "duplicate_custom_id": "custom_id", "invalid_method": "method",
                 "invalid_url": "url"}
"""The line's field each error about the line itself is about, for the ``param`` of a failed batch's ``errors``."""


def _batch_param(error: LineError) -> str | None:
    """The ``param`` of a failed batch's ``errors`` entry: the line's field at fault (``body.temperature``)."""
    if error.status is None:  # no request: the line's own fault
        return PARAM_OF_CODE.get(error.code)
    return "body" if error.param in (None, "body") else f"body.{error.param}"


class BatchDriver:
    def __init__(self, app: web.Application) -> None:
        self._app = app
        self._redis, self._keys, self._config = app[appkeys.REDIS], app[appkeys.KEYS], app[appkeys.CONFIG]
        self._batches, self._files = batch_store(app), file_store(app)
        self._counts = BatchCounts(self._redis, self._keys, self._batches.ttl_s)
        self._name = secrets.token_hex(8)
        self._scanned_at: dict[str, float] = {}
        """Monotonic time each batch's job records were last read (`_count`)."""
        self._outages = OutageLog(log, retry_s=self._config.batch_poll_interval_s)
        self._faults: dict[str, str] = {}
        """The fault each batch whose last step failed met (logged once while it repeats)."""
        self._round_fault: str | None = None
        """The fault of the last round that failed (other than Redis away or full), while rounds keep failing."""

    async def run(self) -> None:
        rounds = 0
        while True:
            try:
                active = sorted(as_bytes(raw).decode() for raw in await self._redis.smembers(self._keys.batches_active))
                for batch_id in in_turn(active, rounds):
                    if await self._lock(batch_id):
                        await self._step_apart(batch_id)
                rounds += 1
            except REDIS_UNAVAILABLE as e:
                self._outages.warn("batch driver", e)
                self._round_fault = None  # the same fault after the outage is said again
            except Exception as e:
                raise_if_cancelled()
                if is_out_of_memory(e):
                    self._outages.warn("batch driver", e, "at its maxmemory, Redis refuses writes")
                elif (fault := f"{type(e).__name__}: {e}") != self._round_fault:
                    # Said once while the same fault repeats (a key of the wrong type fails every round alike).
                    log.exception("batch driver: a round failed; retrying every round until one does not")
                    self._round_fault = fault
            else:
                self._outages.recovered()
                if self._round_fault is not None:
                    log.info("batch driver: rounds go on again")
                    self._round_fault = None
            raise_if_cancelled()
            await asyncio.sleep(self._config.batch_poll_interval_s)

    async def _step_apart(self, batch_id: str) -> None:
        """One batch's step, whose fault stops neither the round nor the other batches: the next round tries it
        again. Redis being away or full ends the round (every batch would meet it); any other fault is logged
        once while it repeats, with the batch it stops."""
        try:
            await self.step(batch_id)
        except Exception as e:
            raise_if_cancelled()
            if isinstance(e, REDIS_UNAVAILABLE) or is_out_of_memory(e):
                raise
            fault = f"{type(e).__name__}: {e}"
            if self._faults.get(batch_id) != fault:
                log.exception("batch driver: batch %s cannot go on (retried every round until it can)", batch_id)
            self._faults[batch_id] = fault
        else:
            if self._faults.pop(batch_id, None) is not None:
                log.info("batch driver: batch %s goes on again", batch_id)

    async def _lock(self, batch_id: str) -> bool:
        key = self._keys.batch_lock(batch_id)
        if await self._redis.set(key, self._name, nx=True, ex=LOCK_S):
            return True
        if await self._redis.get(key) == self._name.encode():
            await self._redis.expire(key, LOCK_S)
            return True
        return False

    async def step(self, batch_id: str) -> None:
        b = await self._batches.read(batch_id)
        status = BatchStatus(b["status"]) if b else None
        if status is None or status in (BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED,
                                        BatchStatus.CANCELLED):
            if b:
                await self._files.release(b["input_file_id"], batch_id)
            await self._redis.srem(self._keys.batches_active, batch_id)
        elif status is BatchStatus.VALIDATING:
            await self._validate(batch_id, b)
        elif status is BatchStatus.FINALIZING:
            await self._finalize(batch_id, b)
        else:
            if status is BatchStatus.IN_PROGRESS:
                await self._enqueue(batch_id, b)
            else:
                await self._cancel_requests(batch_id, b)
            is_cancelling = status is BatchStatus.CANCELLING
            await self._counts.read_results(batch_id, is_cancelling)
            if time.monotonic() - self._scanned_at.get(batch_id, -SCAN_INTERVAL_S) >= SCAN_INTERVAL_S:
                self._scanned_at[batch_id] = time.monotonic()
                await self._counts.scan(batch_id, await self._batches.read(batch_id), is_cancelling)
            b = await self._batches.read(batch_id)
            if int(b["enqueued"]) >= int(b["total"]) and not b.get("input_released"):
                await self._files.release(b["input_file_id"], batch_id)  # every line read: once
                await self._redis.hset(self._keys.batch(batch_id), "input_released", 1)
            if int(b["settled"]) >= int(b["total"]):
                outcome = (BatchStatus.CANCELLED if status is BatchStatus.CANCELLING
                           else BatchStatus.EXPIRED if int(b["expired"]) else BatchStatus.COMPLETED)
                await self._batches.move(batch_id, (status,), BatchStatus.FINALIZING, outcome=outcome.value)

    async def _validate(self, batch_id: str, b: dict[str, str]) -> None:
        """Read every line once: bad ones go to the error list (counted failed), the rest will run.

        A file with no line that can run fails the batch: its ``errors`` list the first line errors (as OpenAI's
        validation does) and its error file, written as for any batch, holds them all."""
        keys, endpoint = self._keys, Endpoint(b["endpoint"])
        total = await self._files.num_lines(b["input_file_id"])
        if total == 0:
            errors = {"object": "list", "data": [{"code": "invalid_file", "param": "input_file_id", "line": None,
                                                  "message": "the input file is empty, deleted or expired"}]}
            await self._batches.move(batch_id, (BatchStatus.VALIDATING,), BatchStatus.FAILED, errors=json.dumps(errors))
            await self._files.release(b["input_file_id"], batch_id)
            return
        await self._redis.delete(keys.batch_custom_ids(batch_id), keys.batch_errors(batch_id),
                                 keys.batch_settled(batch_id))
        counters: dict[FieldT, EncodableT] = {name: 0 for name in COUNTERS}
        await self._redis.hset(keys.batch(batch_id), mapping={**counters, "total": total})
        seen: set[str] = set()
        models = await model_choice(self._app)
        model: str | None = None
        start = num_blank = 0
        listed: list[dict[str, object]] = []
        async for page in self._files.pages(b["input_file_id"]):
            custom_ids: list[str] = []
            bad: list[tuple[int, LineError]] = []
            blank: list[int] = []
            for offset, line in enumerate(page):
                number = start + offset
                if is_blank(line):
                    # Not a request: settled at once, counted nowhere, yet it keeps its line number.
                    blank.append(number)
                    custom_ids.append("")
                    continue
                try:
                    custom_id, job, _ = parse_line(line, endpoint)
                    if custom_id in seen:
                        raise LineError("duplicate_custom_id", f"custom_id {custom_id!r} appears on an earlier line")
                    line_model = job["metadata"]["model"]
                    refusal = models.refusal(line_model)
                    if refusal is not None:
                        raise LineError("model_not_found", f"body: {refusal}", param="model", status=404)
                    model = model or line_model
                    seen.add(custom_id)
                    custom_ids.append(custom_id)
                except LineError as e:
                    bad.append((number, e))
                    loose = _loose_custom_id(line)
                    custom_ids.append(loose or "")
                    if loose is not None:  # taken too: a later line with it is a duplicate, whatever this one was
                        seen.add(loose)
                    if len(listed) < MAX_LISTED_ERRORS:
                        listed.append({"code": e.code, "message": f"line {number + 1}: {e.message}",
                                       "param": _batch_param(e), "line": number + 1})
            start += len(page)
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.rpush(keys.batch_custom_ids(batch_id), *custom_ids)
                for number, error in bad:
                    pipe.hset(keys.batch_errors(batch_id), mapping=error.fields(number))
                await pipe.execute()
            if bad or blank:
                await self._counts.mark(batch_id, [(number, "failed") for number, _ in bad]
                                        + [(number, "dropped") for number in blank])
            num_blank += len(blank)
        await self._redis.hset(keys.batch(batch_id), "blank", num_blank)
        for key in (keys.batch_custom_ids(batch_id), keys.batch_errors(batch_id), keys.batch_settled(batch_id)):
            await self._redis.expire(key, self._batches.ttl_s)
        if model is None:  # no line is a request that can run (uploads refuse a file of blank lines alone)
            await self._batches.move(batch_id, (BatchStatus.VALIDATING,), BatchStatus.FINALIZING,
                                     outcome=BatchStatus.FAILED.value,
                                     errors=json.dumps({"object": "list", "data": listed}))
            await self._files.release(b["input_file_id"], batch_id)
            return
        await self._batches.move(batch_id, (BatchStatus.VALIDATING,), BatchStatus.IN_PROGRESS, model=model)

    async def _enqueue(self, batch_id: str, b: dict[str, str]) -> None:
        cursor, total, endpoint = int(b["enqueued"]), int(b["total"]), Endpoint(b["endpoint"])
        admission = self._app[appkeys.ADMISSION]
        stop = min(total, cursor + MAX_ENQUEUE_PER_ROUND)
        if time.time() >= int(b["expires_at"]):
            await self._counts.mark(batch_id, [(n, "expired") for n in range(cursor, total)])
            await self._redis.hset(self._keys.batch(batch_id), "enqueued", total)
            return
        while cursor < stop:
            page = await self._files.page(b["input_file_id"], cursor, min(PAGE_LINES, stop - cursor))
            if not page:  # the input file was deleted or expired under the batch
                await self._counts.mark_errors(batch_id, range(cursor, total),
                                               LineError("invalid_file", "the input file is gone"))
                cursor = total
                break
            settled = await self._counts.settled_bits(batch_id, cursor, cursor + len(page))
            for offset, line in enumerate(page):
                number = cursor + offset
                if settled[offset]:
                    continue  # refused while validating
                renames: dict[str, str] = {}
                try:
                    _, body, renames = parse_line(line, endpoint)
                    results = self._keys.batch_results(batch_id)
                    admitted = await admission.submit(
                        {**body, "id": f"{batch_id}-{number}", "deadline": float(b["expires_at"]), "reply_to": results},
                        None, caller=Caller(tenant_of(b.get("tenant"))), batch_results=results,
                        linked_trace=b.get("traceparent"))
                    if admitted.is_new:  # a round repeated after a crash finds the line's job already there
                        self._app[appkeys.METRICS].job_submitted(admitted.lane)
                except LaneFull:
                    await self._redis.hset(self._keys.batch(batch_id), "enqueued", number)
                    return  # the batch lane is full: try again next round
                except LineError as e:
                    await self._counts.mark_errors(batch_id, [number], e)
                except InvalidJob as e:  # refused as the online route refuses it, naming what the line named
                    param = openai_param(e.field, renames)
                    code = CONTEXT_LENGTH_EXCEEDED if e.is_context_exceeded else "invalid_value"
                    refused = LineError(code, f"body: {param}: {renamed_in(e.message, renames)}", param=param,
                                        status=400)
                    await self._counts.mark_errors(batch_id, [number], refused)
            cursor += len(page)
        await self._redis.hset(self._keys.batch(batch_id), "enqueued", cursor)

    async def _cancel_requests(self, batch_id: str, b: dict[str, str]) -> None:
        """Drop the lines not enqueued yet and cancel the enqueued ones still waiting or running."""
        enqueued, total = int(b["enqueued"]), int(b["total"])
        if enqueued < total:
            await self._counts.mark(batch_id, [(n, "dropped") for n in range(enqueued, total)])
            await self._redis.hset(self._keys.batch(batch_id), "enqueued", total)
        if b.get("cancel_sent"):
            return
        canceller = self._app[appkeys.CANCELLER]
        low = int(b["low"])
        settled = await self._counts.settled_bits(batch_id, low, enqueued)
        for offset, is_settled in enumerate(settled):
            if not is_settled:
                try:
                    await canceller.cancel(f"{batch_id}-{low + offset}")
                except (JobNotFound, AlreadyFinished):
                    pass
        await self._redis.hset(self._keys.batch(batch_id), "cancel_sent", 1)

    async def _finalize(self, batch_id: str, b: dict[str, str]) -> None:
        """Write the output and error files from the job records, then end the batch."""
        endpoint, keys = Endpoint(b["endpoint"]), self._keys
        out_id, err_id = f"file-{batch_id}-output", f"file-{batch_id}-errors"
        await self._redis.delete(keys.file_lines(out_id), keys.file_lines(err_id))
        out_bytes = err_bytes = num_out = num_err = 0
        start = 0
        while custom_ids := [as_bytes(c).decode() for c in
                             await self._redis.lrange(keys.batch_custom_ids(batch_id), start,
                                                      start + RECORDS_PER_ROUND_TRIP - 1)]:
            numbers = range(start, start + len(custom_ids))
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hmget(keys.batch_errors(batch_id), [str(n) for n in numbers])
                pipe.hmget(keys.batch_errors(batch_id), [answer_field(n) for n in numbers])
                for n in numbers:
                    pipe.hgetall(keys.job(f"{batch_id}-{n}"))
                errors, answers, *records = await pipe.execute()
            out: list[str] = []
            err: list[str] = []
            views = [job_view(record) if record else {} for record in records]
            # A failed request's error names its parameters as its line spelt them: read those lines again.
            lines = (await self._files.page(b["input_file_id"], start, len(custom_ids))
                     if any(v.get("status") == "failed" for v in views) else [])
            for n, custom_id, error, answer, view in zip(numbers, custom_ids, errors, answers, views):
                if error is not None:
                    refused = unpack_error(error, answer)
                    err.append(error_line(custom_id or None, refused.code, f"line {n + 1}: {refused.message}",
                                          status=refused.status, param=refused.param))
                elif not custom_id:
                    continue  # a blank line: every other line has a custom_id or an error
                elif not view:
                    code = "batch_cancelled" if b.get("outcome") == BatchStatus.CANCELLED.value else "batch_expired"
                    err.append(error_line(custom_id, code, f"line {n + 1}: the request never ran"))
                else:
                    is_failed = view.get("status") == "failed" and n - start < len(lines)
                    renames = _renames(endpoint, lines[n - start]) if is_failed else None
                    line, is_output = result_line(endpoint, n, custom_id, view, renames)
                    (out if is_output else err).append(line)
            out_bytes += await self._files.append(out_id, out)
            err_bytes += await self._files.append(err_id, err)
            num_out, num_err = num_out + len(out), num_err + len(err)
            start += len(custom_ids)
        files: dict[str, str | int] = {}
        ttl_s = int(b["output_ttl_s"]) if "output_ttl_s" in b else None  # the batch's output_expires_after
        if num_out:
            await self._files.publish(out_id, f"{batch_id}_output.jsonl", "batch_output", out_bytes,
                                     tenant_of(b.get("tenant")), ttl_s)
            files["output_file_id"] = out_id
        if num_err:
            await self._files.publish(err_id, f"{batch_id}_error.jsonl", "batch_output", err_bytes,
                                     tenant_of(b.get("tenant")), ttl_s)
            files["error_file_id"] = err_id
        outcome = BatchStatus(b.get("outcome", BatchStatus.COMPLETED.value))
        await self._batches.move(batch_id, (BatchStatus.FINALIZING,), outcome, **files)
        await self._redis.srem(keys.batches_active, batch_id)
        await self._redis.delete(keys.batch_results(batch_id))
        self._scanned_at.pop(batch_id, None)


def _renames(endpoint: Endpoint, line: str) -> dict[str, str] | None:
    """The parameters an input line spelt its own way (see `parse_line`); None for a line that no longer parses
    (its job ran, so it did when it was enqueued)."""
    try:
        return parse_line(line, endpoint)[2]
    except LineError:
        return None


def in_turn(batch_ids: list[str], round_number: int) -> list[str]:
    """The active batches in the order round `round_number` steps them: each batch first in turn. With the batch
    lane full, the first batch of a round takes the slots the finished jobs freed; were the order the same
    every round, one batch (one tenant) would take them all while the others waited behind it."""
    if not batch_ids:
        return []
    start = round_number % len(batch_ids)
    return batch_ids[start:] + batch_ids[:start]


def _loose_custom_id(line: str) -> str | None:
    """The custom_id of a line refused for another reason, when it has one (for the error file)."""
    try:
        return custom_id_of(load_line(line))
    except (ValueError, RecursionError):
        return None
