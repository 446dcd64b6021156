r"""Files of the Batch API, kept in Redis: ``POST/GET/DELETE /v1/files[/{id}[/content]]``.

A file is a metadata hash plus a list holding one element per line, each with
its own line ending (``\n``, ``\r\n``, or none on a last line without one), so
the elements joined are the uploaded bytes exactly, and element ``i`` is line
``i + 1`` of the user's file, blank lines included. A 50,000-line file is 50,000
small list elements (read in pages with LRANGE), never one giant value. Both
keys expire after ``--file-ttl-s``, or sooner when the upload's ``expires_after``
asks (a batch's ``output_expires_after`` for its output files). Uploads are streamed and refused past
``--max-batch-file-bytes`` (413), or with more than ``--max-batch-requests``
requests (non-blank lines) or blank lines (400).
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import redis.asyncio as aioredis
from aiohttp import BodyPartReader, web
from redis.typing import EncodableT, FieldT

from gateway import appkeys
from gateway.access_log import note
from gateway.auth import caller_of, may_see
from gateway.errors import OpenAIError, invalid
from gateway.openai.listing import cursor_page
from scheduler.protocol import state_machine
from scheduler.protocol.keys import Keys
from scheduler.protocol.redis_replies import as_bytes, read_hash
from scheduler.protocol.tenants import DEFAULT_TENANT, tenant_of

routes = web.RouteTableDef()

PAGE_LINES = 1000
STAGED_LINES = 10 * PAGE_LINES
"""Lines of an upload written to Redis per round trip."""
STAGING_TTL_S = 3600
"""How long an upload's staging list lives without a write (a gateway stopped midway)."""
"""Lines per LRANGE / RPUSH when reading or writing a file."""
PURPOSES = ("batch",)
MAX_LIST_LIMIT = 10_000
"""OpenAI's largest (and default) ``limit`` of ``GET /v1/files``."""
EXPIRES_AFTER_S = (3600, 30 * 24 * 3600)
"""OpenAI's range of an expiry policy's ``seconds`` (``expires_after``, a batch's ``output_expires_after``)."""


class FileStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys, ttl_s: int) -> None:
        self._redis, self._keys, self._ttl_s = redis, keys, ttl_s
        self._delete = redis.register_script(state_machine.FILE_DELETE)
        self._release = redis.register_script(state_machine.FILE_RELEASE)

    async def write(self, file_id: str, filename: str, purpose: str, lines: Sequence[bytes],
                    tenant: str = DEFAULT_TENANT, ttl_s: int | None = None) -> dict[str, Any]:
        """Store (or replace) a whole file of `tenant`'s, to expire after `ttl_s` (default ``--file-ttl-s``);
        returns its view.

        `lines` keep their line endings (`split_lines`): joined, they are the file. They go to a staging list a
        few pages a round trip (so no command holding the whole file is built), which one transaction then renames
        into place and lists: readers see the whole file or none of it."""
        lines_key, staging = self._keys.file_lines(file_id), self._keys.file_staging(file_id)
        await self._redis.delete(staging)
        for start in range(0, len(lines), STAGED_LINES):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.rpush(staging, *lines[start:start + STAGED_LINES])
                pipe.expire(staging, STAGING_TTL_S)  # a gateway that dies midway leaves nothing for long
                await pipe.execute()
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(lines_key)
            if lines:
                pipe.rename(staging, lines_key)
            return await self._publish(pipe, file_id, filename, purpose, sum(len(line) for line in lines),
                                       tenant, ttl_s)

    async def append(self, file_id: str, lines: Sequence[str]) -> int:
        r"""Add lines (without line endings; each gets ``\n``) to a file being built (not listed until `publish`);
        returns their size in bytes."""
        ended = [line + "\n" for line in lines]
        if ended:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.rpush(self._keys.file_lines(file_id), *ended)
                pipe.expire(self._keys.file_lines(file_id), self._ttl_s)
                await pipe.execute()
        return sum(len(line.encode()) for line in ended)

    async def publish(self, file_id: str, filename: str, purpose: str, num_bytes: int,
                      tenant: str = DEFAULT_TENANT, ttl_s: int | None = None) -> dict[str, Any]:
        """List a file built with `append`, as `tenant`'s, to expire after `ttl_s` (default ``--file-ttl-s``)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            return await self._publish(pipe, file_id, filename, purpose, num_bytes, tenant, ttl_s)

    async def _publish(self, pipe: aioredis.client.Pipeline, file_id: str, filename: str, purpose: str, num_bytes: int,
                       tenant: str, ttl_s: int | None) -> dict[str, Any]:
        lines_key = self._keys.file_lines(file_id)
        created_s = time.time()
        created_at = int(created_s)
        ttl_s = self._ttl_s if ttl_s is None else ttl_s
        meta: dict[FieldT, EncodableT] = {"id": file_id, "filename": filename, "purpose": purpose,
                                          "bytes": num_bytes, "created_at": created_at,
                                          "expires_at": created_at + ttl_s, "tenant": tenant}
        pipe.hset(self._keys.file(file_id), mapping=meta)
        pipe.expire(lines_key, ttl_s)
        pipe.expire(self._keys.file(file_id), ttl_s)
        pipe.zadd(self._keys.files, {file_id: created_s})  # sub-second: newest first within a second too
        pipe.zremrangebyscore(self._keys.files, "-inf", created_at - self._ttl_s)  # expired ones
        await pipe.execute()
        return self.view({str(k).encode(): str(v).encode() for k, v in meta.items()})

    async def get(self, file_id: str) -> dict[str, Any] | None:
        meta = await read_hash(self._redis, self._keys.file(file_id))
        return self.view(meta) if meta else None

    async def tenant(self, file_id: str) -> str:
        """Whose the file is (files written before tenants existed are the default tenant's)."""
        raw = await self._redis.hget(self._keys.file(file_id), "tenant")
        return tenant_of(None if raw is None else as_bytes(raw).decode())

    async def num_lines(self, file_id: str) -> int:
        return int(await self._redis.llen(self._keys.file_lines(file_id)))

    async def page(self, file_id: str, start: int, count: int = PAGE_LINES) -> list[str]:
        raw = await self._redis.lrange(self._keys.file_lines(file_id), start, start + count - 1)
        return [as_bytes(line).decode("utf-8", "replace") for line in raw]

    async def pages(self, file_id: str) -> AsyncIterator[list[str]]:
        start = 0
        while page := await self.page(file_id, start):
            yield page
            start += len(page)

    async def hold(self, file_id: str, batch_id: str, until_s: int) -> None:
        """Keep the file's lines for `batch_id` until it `release`s them, or until `until_s` (unix seconds) at
        the latest: a delete or expiry of the file meanwhile removes it from the caller's view only."""
        lines_key, readers_key = self._keys.file_lines(file_id), self._keys.file_readers(file_id)
        held_s = max(1, until_s - int(time.time()))
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.ttl(lines_key)
            pipe.ttl(readers_key)
            lines_ttl_s, readers_ttl_s = (int(t) for t in await pipe.execute())
        if lines_ttl_s == -2:
            return  # gone already: the batch finds it empty and fails, as OpenAI's validation does
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.sadd(readers_key, batch_id)
            pipe.expire(readers_key, max(held_s, readers_ttl_s))
            if 0 <= lines_ttl_s < held_s:  # lines without an expiry keep none
                pipe.expire(lines_key, held_s)
            await pipe.execute()

    async def release(self, file_id: str, batch_id: str) -> None:
        """`batch_id` reads the file no more (see `hold`)."""
        await self._release(keys=[self._keys.file(file_id), self._keys.file_lines(file_id),
                                  self._keys.file_readers(file_id)], args=[batch_id])

    async def delete(self, file_id: str) -> bool:
        # The id leaves the list's index for the deleted ones' with its score, so a client paging with
        # ``after=`` that id, the last of the page it just read, still gets the next page.
        score = await self._redis.zscore(self._keys.files, file_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            await self._delete(keys=[self._keys.file(file_id), self._keys.file_lines(file_id),
                                     self._keys.file_readers(file_id)], client=pipe)
            pipe.zrem(self._keys.files, file_id)
            if score is not None:
                pipe.zadd(self._keys.files_deleted, {file_id: score})
            pipe.zremrangebyscore(self._keys.files_deleted, "-inf", time.time() - self._ttl_s)
            deleted, *_ = await pipe.execute()
        return bool(deleted)

    def view(self, meta: dict[bytes, bytes]) -> dict[str, Any]:
        created = int(meta[b"created_at"])
        # Files stored before expiry policies were taken hold no expires_at: they live --file-ttl-s.
        expires = int(meta[b"expires_at"]) if b"expires_at" in meta else created + self._ttl_s
        return {"id": meta[b"id"].decode(), "object": "file", "bytes": int(meta[b"bytes"]), "created_at": created,
                "expires_at": expires, "filename": meta[b"filename"].decode(),
                "purpose": meta[b"purpose"].decode(), "status": "processed", "status_details": None}


def split_lines(data: bytes) -> list[bytes]:
    r"""The lines of `data`, each keeping its ending: ``b"a\r\n\nb"`` -> ``[b"a\r\n", b"\n", b"b"]``.

    Only ``\n`` ends a line (as JSONL has it), so the lines joined are `data` again."""
    if b"\r" not in data:  # bytes' splitlines ends lines at \r too; without one it splits as JSONL does
        return data.splitlines(keepends=True)
    parts = data.split(b"\n")
    return [part + b"\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def is_blank(line: str | bytes) -> bool:
    """Whether a line holds only JSON whitespace (after a first line's byte-order mark): not a request, skipped,
    but still counted in line numbers."""
    if isinstance(line, bytes):
        return not line.removeprefix(b"\xef\xbb\xbf").strip(b" \t\r\n")
    return not line.removeprefix("\ufeff").strip(" \t\r\n")


def expiry_seconds(param: str, policy: object, max_ttl_s: int) -> int:
    """The seconds of an OpenAI expiry policy ``{"anchor": "created_at", "seconds": N}`` named `param`; a 400 when
    it is malformed, outside OpenAI's range, or longer than this server keeps files (`max_ttl_s`)."""
    if not isinstance(policy, dict) or set(policy) != {"anchor", "seconds"}:
        raise invalid(param, 'must be {"anchor": "created_at", "seconds": N}')
    if policy["anchor"] != "created_at":
        raise invalid(f"{param}.anchor", "must be created_at")
    seconds = policy["seconds"]
    if isinstance(seconds, str) and re.fullmatch(r"[0-9]{1,10}", seconds.strip()):  # a multipart field is text
        seconds = int(seconds)
    if not isinstance(seconds, int) or isinstance(seconds, bool):
        raise invalid(f"{param}.seconds", "must be an integer")
    low, high = EXPIRES_AFTER_S
    if not low <= seconds <= high:
        raise invalid(f"{param}.seconds", f"must be within [{low}, {high}]")
    if seconds > max_ttl_s:
        raise invalid(f"{param}.seconds", f"this server keeps files at most {max_ttl_s} s (--file-ttl-s)")
    return seconds


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def file_store(app: web.Application) -> FileStore:
    return FileStore(app[appkeys.REDIS], app[appkeys.KEYS], app[appkeys.CONFIG].file_ttl_s)


async def _read_form(request: web.Request,
                     max_file_bytes: int) -> tuple[str | None, str | None, bytearray | None, dict[str, str]]:
    """(purpose, file name, file bytes, expires_after's fields) of an upload's form; raises ValueError for a
    body that is no multipart/form-data (RuntimeError for a part's unknown transfer encoding), OpenAIError for
    fields refused."""
    reader = await request.multipart()
    purpose, filename, data = None, None, None
    expires_after: dict[str, str] = {}
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            raise invalid("file", "nested multipart bodies are not supported")
        if part.name == "purpose":
            purpose = await _read_text(part)
        elif part.name == "file":
            filename = part.filename or "upload.jsonl"
            data = await _read_limited(part, max_file_bytes)
        elif part.name in ("expires_after[anchor]", "expires_after[seconds]"):  # how clients send the policy
            expires_after[part.name.removeprefix("expires_after[").removesuffix("]")] = await _read_text(part)
        else:
            await part.release()
    return purpose, filename, data, expires_after


@routes.post("/v1/files")
async def upload(request: web.Request) -> web.Response:
    config = request.app[appkeys.CONFIG]
    if not request.content_type.startswith("multipart/"):
        raise invalid("file", "upload the file as multipart/form-data with fields file and purpose")
    try:
        purpose, filename, data, expires_after = await _read_form(request, config.max_batch_file_bytes)
    except UnicodeError as e:  # a boundary that is no ASCII, the request's or a part's
        raise invalid("file", "the multipart/form-data body cannot be read: a boundary must be ASCII") from e
    # aiohttp's reader: no starting boundary, a body cut short (ValueError); a part's unknown
    # Content-Transfer-Encoding (RuntimeError).
    except (ValueError, RuntimeError) as e:
        raise invalid("file", f"the multipart/form-data body cannot be read: {ascii(str(e))[1:-1][:200]}") from e
    if purpose not in PURPOSES:
        raise invalid("purpose", f"must be one of {list(PURPOSES)}")
    ttl_s = expiry_seconds("expires_after", expires_after, config.file_ttl_s) if expires_after else None
    if data is None or filename is None:
        raise invalid("file", "required")
    # Kept as bytes, line by line, and the whole file let go at once: an upload holds about twice its size at most.
    lines = split_lines(bytes(data))
    del data
    for number, line in enumerate(lines, start=1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise invalid("file", f"must be UTF-8 JSONL: line {number}: {e}") from e
    num_requests = sum(not is_blank(line) for line in lines)
    if not num_requests:
        raise invalid("file", "holds no requests (no line but blank ones)")
    if num_requests > config.max_batch_requests:
        raise invalid("file", f"{num_requests} requests; a batch takes at most {config.max_batch_requests}")
    if len(lines) - num_requests > config.max_batch_requests:
        raise invalid("file", f"{len(lines) - num_requests} blank lines; a file may hold at most "
                              f"{config.max_batch_requests}")
    view = await file_store(request.app).write(new_file_id(), filename, purpose, lines, caller_of(request).tenant,
                                               ttl_s)
    note(request, file_id=view["id"])
    return web.json_response(view)


async def _read_text(part: BodyPartReader) -> str:
    return (await part.read(decode=True)).decode("utf-8", "replace").strip()


async def _read_limited(part: BodyPartReader, max_bytes: int) -> bytearray:
    data = bytearray()  # grown in place: one copy of the file, not its chunks and their join
    while chunk := await part.read_chunk(64 * 1024):
        if len(data) + len(chunk) > max_bytes:
            raise OpenAIError(413, f"the file is larger than this server's limit of {max_bytes} bytes",
                              param="file", code="file_too_large")
        data += chunk
    return data


@routes.get("/v1/files")
async def list_files(request: web.Request) -> web.Response:
    """OpenAI's file list: newest first (``order=asc``: oldest first), ``limit`` (at most 10,000, the default),
    ``after``, and ``purpose`` to keep one purpose's files."""
    store = file_store(request.app)
    purpose = request.query.get("purpose")

    async def read(file_id: str) -> tuple[dict[bytes, bytes], str]:
        """The file's hash (empty when it is gone) and whose it is, in one read."""
        meta = await read_hash(request.app[appkeys.REDIS], request.app[appkeys.KEYS].file(file_id))
        return meta, tenant_of(meta[b"tenant"].decode() if b"tenant" in meta else None)

    async def may_name_file(file_id: str) -> bool:
        meta, owner = await read(file_id)
        return not meta or may_see(request, owner)  # one gone by its own expiry is still a place in the list

    async def load(file_id: str) -> dict[str, Any] | None:
        meta, owner = await read(file_id)
        if not meta or not may_see(request, owner):
            return None
        view = store.view(meta)
        return view if purpose in (None, view["purpose"]) else None

    keys = request.app[appkeys.KEYS]
    page = await cursor_page(request, request.app[appkeys.REDIS], keys.files, load, may_name_file,
                             default_limit=MAX_LIST_LIMIT, max_limit=MAX_LIST_LIMIT, deleted_key=keys.files_deleted)
    return web.json_response(page)


@routes.get("/v1/files/{id}")
async def get_file(request: web.Request) -> web.Response:
    return web.json_response(await _existing(request))


@routes.get("/v1/files/{id}/content")
async def file_content(request: web.Request) -> web.StreamResponse:
    view = await _existing(request)
    store = file_store(request.app)
    num_lines = await store.num_lines(view["id"])
    response = web.StreamResponse(headers={"Content-Type": "application/jsonl"})
    await response.prepare(request)
    number = 0
    async for page in store.pages(view["id"]):
        chunk = []
        for line in page:
            number += 1
            # Files stored before lines kept their endings hold none: those lines get a "\n".
            chunk.append(line if line.endswith("\n") or number == num_lines else line + "\n")
        await response.write("".join(chunk).encode())
    await response.write_eof()
    return response


@routes.delete("/v1/files/{id}")
async def delete_file(request: web.Request) -> web.Response:
    file_id = request.match_info["id"]
    store = file_store(request.app)
    if not may_see(request, await store.tenant(file_id)) or not await store.delete(file_id):
        raise OpenAIError(404, f"No such file: {file_id}", param="file_id", code="not_found")
    return web.json_response({"id": file_id, "object": "file", "deleted": True})


async def _existing(request: web.Request) -> dict[str, Any]:
    file_id = request.match_info["id"]
    store = file_store(request.app)
    view = await store.get(file_id)
    if view is None or not may_see(request, await store.tenant(file_id)):
        raise OpenAIError(404, f"No such file: {file_id}", param="file_id", code="not_found")
    return view
