"""What the real `openai` client reads beyond the bodies: request ids, list order and list pages."""

from __future__ import annotations

import asyncio
import io
import json

import aiohttp
import openai

from tests.harness.openai_support import MODEL_NAME, openai_service


def batch_line(i: int) -> str:
    return json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                       "body": {"model": MODEL_NAME, "prompt": f"line {i}", "max_tokens": 2}})


async def upload(client: openai.AsyncOpenAI, name: str) -> str:
    created = await client.files.create(file=(name, io.BytesIO(batch_line(0).encode())), purpose="batch")
    return created.id


async def test_every_answer_carries_an_x_request_id_the_client_reads(redis_url, tiny_model) -> None:
    from worker.engine.engine import Engine

    async with openai_service(redis_url, Engine(model=tiny_model(), max_num_seqs=2)) as svc:
        listed = await svc.client.models.with_raw_response.list()
        chat = await svc.client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        stream = await svc.client.chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True)
        async for _ in stream.parse():
            pass
        ids = [listed.headers.get("x-request-id"), chat._request_id, stream.headers.get("x-request-id")]
        for error_call in (svc.client.batches.retrieve("batch_none"),
                           svc.client.chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=2),
                           svc.client.embeddings.create(model=MODEL_NAME, input="x")):
            try:
                await error_call
                raise AssertionError("no error")
            except openai.APIStatusError as e:
                ids.append(e.request_id)
    assert all(isinstance(i, str) and i.startswith("req_") for i in ids), ids
    assert len(set(ids)) == len(ids)


async def test_batches_are_listed_newest_first_also_within_one_second(redis_url) -> None:
    import redis.asyncio as aioredis

    from scheduler.protocol.keys import Keys

    keys, redis = Keys(), aioredis.Redis.from_url(redis_url)
    async with openai_service(redis_url, None, batch_poll_interval_s=60) as svc:
        file_id = await upload(svc.client, "one.jsonl")
        created = [(await svc.client.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                                    completion_window="24h")).id for _ in range(8)]
        first = await svc.client.batches.list(limit=3)
        assert [b.id for b in first.data] == created[::-1][:3] and first.has_more
        assert [b.id async for b in svc.client.batches.list(limit=3)] == created[::-1]
        newest = await svc.client.batches.list(limit=1)
        assert newest.data[0].id == created[-1]
        # A batch record gone by expiry before the index dropped it: paging on from it still works.
        await redis.delete(keys.batch(first.data[-1].id))
        rest = await svc.client.batches.list(after=first.data[-1].id, limit=100)
        assert [b.id for b in rest.data] == created[::-1][3:]


async def test_files_are_listed_newest_first_in_pages_by_purpose_and_order(redis_url) -> None:
    import redis.asyncio as aioredis

    from scheduler.protocol.keys import Keys

    keys, redis = Keys(), aioredis.Redis.from_url(redis_url)
    async with openai_service(redis_url, None) as svc:
        created = [await upload(svc.client, f"f{i}.jsonl") for i in range(5)]
        page = await svc.client.files.list(limit=2)
        assert [f.id for f in page.data] == created[::-1][:2] and page.has_more
        assert [f.id async for f in svc.client.files.list(limit=2)] == created[::-1]
        assert [f.id async for f in svc.client.files.list(limit=2, order="asc")] == created
        assert [f.id async for f in svc.client.files.list(purpose="batch")] == created[::-1]
        assert [f.id async for f in svc.client.files.list(purpose="batch_output")] == []
        after = await svc.client.files.list(after=created[3], limit=10)
        assert [f.id for f in after.data] == created[2::-1] and not after.has_more
        # Another client deletes the last file of the page just read: the next page still follows it.
        page = await svc.client.files.list(limit=2)
        await svc.client.files.delete(page.data[-1].id)
        rest = await svc.client.files.list(after=page.data[-1].id, limit=10)
        assert [f.id for f in rest.data] == created[2::-1] and not rest.has_more
        rest = await svc.client.files.list(after=page.data[-1].id, limit=10, order="asc")
        assert [f.id for f in rest.data] == [created[4]] and not rest.has_more
        assert [f.id async for f in svc.client.files.list(limit=2)] == [created[4], *created[2::-1]]
        # A file gone by its own (shorter) expiry still holds its place: a page that ended on it goes on.
        page = await svc.client.files.list(limit=2)
        await redis.delete(keys.file(page.data[-1].id), keys.file_lines(page.data[-1].id))
        rest = await svc.client.files.list(after=page.data[-1].id, limit=10)
        assert [f.id for f in rest.data] == created[1::-1] and not rest.has_more
        try:
            await svc.client.files.list(limit=0)
            raise AssertionError("limit 0 accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == "limit"


async def test_response_format_text_is_taken_as_the_default_it_is_and_others_are_refused(redis_url, tiny_model) -> None:
    from worker.engine.engine import Engine

    messages = [{"role": "user", "content": "hi"}]
    async with openai_service(redis_url, Engine(model=tiny_model(), max_num_seqs=2)) as svc:
        chat = await svc.client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2,
                                                        response_format={"type": "text"})
        assert chat.usage.completion_tokens == 2
        for response_format in ({"type": "json_object"},
                                {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}):
            try:
                await svc.client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2,
                                                         response_format=response_format)
                raise AssertionError(f"{response_format} accepted")
            except openai.BadRequestError as e:
                assert e.body["param"] == "response_format" and e.body["code"] == "unsupported_parameter"


async def test_an_upload_and_a_batchs_output_expire_as_their_policies_ask(redis_url) -> None:
    """`expires_after` of an upload and `output_expires_after` of a batch, as the client sends them: the file
    object says when, and Redis drops the file then. A policy outside OpenAI's range, with another anchor, or
    longer than this server keeps files (--file-ttl-s, a week by default) is a 400 naming the field."""
    import redis.asyncio as aioredis

    from scheduler.protocol.keys import Keys

    keys, redis = Keys(), aioredis.Redis.from_url(redis_url)
    async with openai_service(redis_url, None, batch_poll_interval_s=0.1) as svc:
        data = io.BytesIO(b"not a request\n")
        hour = await svc.client.files.create(file=("a.jsonl", data), purpose="batch",
                                             expires_after={"anchor": "created_at", "seconds": 3600})
        assert hour.expires_at == hour.created_at + 3600
        assert (await svc.client.files.retrieve(hour.id)).expires_at == hour.expires_at
        assert 3590 <= await redis.ttl(keys.file(hour.id)) <= 3600
        assert 3590 <= await redis.ttl(keys.file_lines(hour.id)) <= 3600
        default = await svc.client.files.create(file=("b.jsonl", io.BytesIO(b"x\n")), purpose="batch")
        assert default.expires_at == default.created_at + 7 * 24 * 3600

        for policy, param in (({"anchor": "created_at", "seconds": 60}, "expires_after.seconds"),
                              ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor"),
                              ({"anchor": "created_at", "seconds": 30 * 24 * 3600}, "expires_after.seconds")):
            try:
                await svc.client.files.create(file=("c.jsonl", io.BytesIO(b"x\n")), purpose="batch",
                                              expires_after=policy)  # type: ignore[arg-type]
                raise AssertionError(f"{policy} accepted")
            except openai.BadRequestError as e:
                assert e.param == param, e.body
        # The form's text as any client might send it: digits of other scripts, thousands of them, half a policy.
        for fields, param in (({"expires_after[anchor]": "created_at", "expires_after[seconds]": "\u00b2"},
                               "expires_after.seconds"),
                              ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "9" * 5000},
                               "expires_after.seconds"),
                              ({"expires_after[seconds]": "3600"}, "expires_after")):
            form = aiohttp.FormData({"purpose": "batch", **fields})
            form.add_field("file", b"x\n", filename="d.jsonl")
            async with aiohttp.ClientSession() as http, http.post(f"{svc.url}/v1/files", data=form) as resp:
                assert (resp.status, (await resp.json())["error"]["param"]) == (400, param)

        # Every line of this one is refused, so its error file is written at once: two hours, as asked.
        batch = await svc.client.batches.create(input_file_id=hour.id, endpoint="/v1/completions",
                                                completion_window="24h",
                                                output_expires_after={"anchor": "created_at", "seconds": 7200})
        while batch.status not in ("completed", "failed"):
            await asyncio.sleep(0.1)
            batch = await svc.client.batches.retrieve(batch.id)
        assert batch.error_file_id is not None
        errors = await svc.client.files.retrieve(batch.error_file_id)
        assert errors.expires_at == errors.created_at + 7200
        assert 7190 <= await redis.ttl(keys.file_lines(batch.error_file_id)) <= 7200
        try:
            await svc.client.batches.create(input_file_id=hour.id, endpoint="/v1/completions", completion_window="24h",
                                            output_expires_after={"anchor": "created_at", "seconds": "soon"})  # type: ignore[typeddict-item]
            raise AssertionError("a non-integer output_expires_after.seconds accepted")
        except openai.BadRequestError as e:
            assert e.param == "output_expires_after.seconds"
    await redis.aclose()
