"""The Batch API against a real gateway, real workers and the real `openai` client."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import signal
import time

import aiohttp
import openai

from gateway.webhooks import generate_secret
from gateway.webhooks.config import WebhookConfig
from scheduler.params import SamplingParams
from tests.harness.child_env import child_pythonpath
from tests.harness.openai_support import MODEL_NAME, openai_service, start_worker
from tests.harness.webhook_receiver import Receiver
from tests.harness.worker_harness import KEYS, wait_until

CHAT = "/v1/chat/completions"
SECRET = generate_secret()


def chat_line(i: int, max_tokens: int = 4) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": CHAT,
            "body": {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"question number {i}"}],
                     "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}


BAD_LINES = {
    "not json": "this is not json",
    "a model not served": json.dumps({**chat_line(999), "body": {**chat_line(999)["body"], "model": "gpt-4o"}}),
    "missing custom_id": json.dumps({k: v for k, v in chat_line(1000).items() if k != "custom_id"}),
    "empty custom_id": json.dumps({**chat_line(1001), "custom_id": ""}),
    "duplicate custom_id": json.dumps({**chat_line(1002), "custom_id": "req-3"}),
    "wrong url": json.dumps({**chat_line(1003), "url": "/v1/embeddings"}),
    "wrong method": json.dumps({**chat_line(1004), "method": "GET"}),
    "bad value": json.dumps({**chat_line(1005), "body": {**chat_line(1005)["body"], "temperature": -1}}),
    "unsupported parameter": json.dumps({**chat_line(1006), "body": {**chat_line(1006)["body"],
                                                                     "tools": [{"type": "function", "function": {"name": "f"}}]}}),
    "no messages": json.dumps({**chat_line(1007), "body": {"model": MODEL_NAME}}),
}
EXPECTED_CODES = ["invalid_json", "model_not_found", "missing_custom_id", "missing_custom_id", "duplicate_custom_id",
                  "invalid_url", "invalid_method", "invalid_value", "unsupported_parameter", "invalid_value"]


def offline_chat(model: str, indices: list[int], max_tokens: int) -> dict[str, str]:
    from transformers import AutoTokenizer

    from worker.engine.engine import Engine
    from worker.engine.prompt_input import apply_chat_template

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [apply_chat_template(tokenizer, chat_line(i)["body"]["messages"]) for i in indices]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = Engine(model=model, max_num_seqs=16).generate(prompts, params)
    return {f"req-{i}": out.text for i, out in zip(indices, outs)}


async def wait_batch(client: openai.AsyncOpenAI, batch_id: str, statuses: set[str], timeout_s: float = 120,
                     until=None):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in statuses or (until is not None and until(batch)):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        await asyncio.sleep(0.2)


def line_error(line: dict) -> dict:
    """An error-file line's error: a request's HTTP answer (its ``response.body.error``, as OpenAI writes a
    request that failed) or the line's own ``error`` (a line that is no request, or a request that never ran)."""
    if line["response"] is not None:
        assert line["error"] is None and line["response"]["status_code"] >= 400, line
        return line["response"]["body"]["error"]
    return line["error"]


async def read_lines(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines()]


async def upload(client: openai.AsyncOpenAI, lines: list[str]) -> str:
    data = io.BytesIO(("\n".join(lines) + "\n").encode())
    created = await client.files.create(file=("batch.jsonl", data), purpose="batch")
    assert created.bytes == len(data.getvalue()) and created.purpose == "batch"
    return created.id


def webhook_settings() -> dict:
    """Gateway settings that run its webhook dispatcher, signing with SECRET, allowed to call 127.0.0.1."""
    return {"no_webhooks": False, "webhooks": WebhookConfig(
        webhook_secret=SECRET, webhook_allow=["127.0.0.1"], webhook_poll_s=0.02, webhook_jitter=0.0)}


async def the_callback(receiver: Receiver, batch_id: str, event_type: str) -> dict:
    """The one signed callback of a batch: verified by `standardwebhooks` (the receiver) and by OpenAI's own
    client, which parses it into its batch event type."""
    await wait_until(lambda: bool(receiver.received), f"the {event_type} callback of {batch_id}")
    [got] = receiver.received
    assert receiver.bad_signatures == 0
    event = openai.OpenAI(api_key="unused").webhooks.unwrap(got.body, got.headers, secret=SECRET)
    assert (event.type, event.data.id, event.object) == (event_type, batch_id, "event")
    return got.payload


async def test_a_batch_with_bad_lines_runs_the_rest_like_the_offline_engine(redis_url, tiny_model) -> None:
    from worker.engine.engine import Engine

    model = tiny_model()
    good = [json.dumps(chat_line(i)) for i in range(190)]
    lines = list(good)
    for n, bad in enumerate(BAD_LINES.values()):
        lines.insert(7 + n * 19, bad)
    expected = offline_chat(model, list(range(190)), 4)
    receiver = await Receiver(SECRET).start()
    async with openai_service(redis_url, Engine(model=model, max_num_seqs=16), batch_poll_interval_s=0.1,
                              **webhook_settings()) as svc:
        file_id = await upload(svc.client, lines)
        assert (await svc.client.files.retrieve(file_id)).id == file_id
        assert (await svc.client.files.content(file_id)).text.splitlines() == lines
        try:
            await svc.client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h",
                                            extra_body={"webhook": {"url": "http://10.1.2.3/hook"}})
            raise AssertionError("a webhook to a private address was accepted")
        except openai.BadRequestError as e:
            assert e.param == "webhook.url"
        batch = await svc.client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h",
                                                metadata={"run": "test"}, extra_body={"webhook": {"url": receiver.url}})
        assert batch.status == "validating" and batch.metadata == {"run": "test"}
        batch = await wait_batch(svc.client, batch.id, {"completed", "failed", "expired", "cancelled"})
        assert batch.status == "completed"
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (200, 190, 10)
        assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
        assert batch.model == MODEL_NAME and batch.usage.output_tokens == 190 * 4
        assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
        payload = await the_callback(receiver, batch.id, "batch.completed")
        assert payload["data"]["request_counts"] == {"total": 200, "completed": 190, "failed": 10}
        assert payload["data"]["output_file_id"] == batch.output_file_id and payload["data"]["status"] == "completed"

        outputs = await read_lines(svc.client, batch.output_file_id)
        assert {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in outputs} == expected
        assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in outputs)
        errors = await read_lines(svc.client, batch.error_file_id)
        assert [line_error(e)["code"] for e in errors] == EXPECTED_CODES
        assert [int(line_error(e)["message"].split(":")[0].removeprefix("line ")) for e in errors] == \
            [8 + n * 19 for n in range(10)]
        assert "tools" in line_error(errors[8])["message"] and "temperature" in line_error(errors[7])["message"]
        # A refused request has the online route's answer: its status, code and parameter.
        assert [(e["response"]["status_code"], line_error(e)["param"]) for e in errors[7:]] == \
            [(400, "temperature"), (400, "tools"), (400, "messages")]
        assert (errors[1]["response"]["status_code"], line_error(errors[1])["param"]) == (404, "model")
        assert errors[4]["custom_id"] == "req-3"
        # The batch's jobs count as the batch lane's submissions, as any job enqueued does.
        async with aiohttp.ClientSession() as http, http.get(f"{svc.url}/metrics") as resp:
            exposition = await resp.text()
        [submitted] = re.findall(r'^carpool_jobs_submitted_total\{[^}]*carpool_lane="batch"[^}]*\} (\S+)$', exposition,
                                 re.MULTILINE)
        assert float(submitted) == 190

        await receiver.stop()
        listed = await svc.client.batches.list(limit=5)
        assert [b.id for b in listed.data] == [batch.id]
        await svc.client.files.delete(file_id)
        try:
            await svc.client.files.retrieve(file_id)
            raise AssertionError("deleted file still there")
        except openai.NotFoundError:
            pass


async def test_cancelling_a_batch_keeps_finished_results(redis_url, tiny_model) -> None:
    from worker.engine.engine import Engine

    model = tiny_model()
    lines = [json.dumps(chat_line(i, max_tokens=24)) for i in range(200)]
    receiver = await Receiver(SECRET).start()
    async with openai_service(redis_url, Engine(model=model, max_num_seqs=4), batch_poll_interval_s=0.1,
                              **webhook_settings()) as svc:
        batch = await svc.client.batches.create(input_file_id=await upload(svc.client, lines), endpoint=CHAT,
                                                completion_window="24h", extra_body={"webhook": {"url": receiver.url}})
        await wait_batch(svc.client, batch.id, set(), until=lambda b: b.request_counts.completed >= 5)
        cancelling = await svc.client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling"
        batch = await wait_batch(svc.client, batch.id, {"cancelled"})
        assert 5 <= batch.request_counts.completed < 200 and batch.request_counts.failed == 0
        outputs = await read_lines(svc.client, batch.output_file_id)
        assert len(outputs) == batch.request_counts.completed
        errors = await read_lines(svc.client, batch.error_file_id)
        assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
        assert len(outputs) + len(errors) == 200
        payload = await the_callback(receiver, batch.id, "batch.cancelled")
        assert payload["data"]["request_counts"]["completed"] == batch.request_counts.completed
        await receiver.stop()


async def test_a_batch_survives_a_worker_sigkill_and_a_gateway_restart(redis_url, tiny_model, tmp_path) -> None:
    model = tiny_model()
    lines = [json.dumps(chat_line(i, max_tokens=16)) for i in range(80)]
    expected = offline_chat(model, list(range(80)), 16)
    first = start_worker(redis_url, model, "first", tmp_path / "first.log")
    second = None
    try:
        async with openai_service(redis_url, None, batch_poll_interval_s=0.1) as svc:
            batch = await svc.client.batches.create(input_file_id=await upload(svc.client, lines), endpoint=CHAT,
                                                    completion_window="24h")
            await wait_batch(svc.client, batch.id, set(), timeout_s=180, until=lambda b: b.request_counts.completed >= 8)
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = start_worker(redis_url, model, "second", tmp_path / "second.log")
        async with openai_service(redis_url, None, batch_poll_interval_s=0.1) as svc:
            done = await wait_batch(svc.client, batch.id, {"completed", "failed", "expired", "cancelled"}, timeout_s=180)
            assert done.status == "completed", (tmp_path / "second.log").read_text()
            assert (done.request_counts.completed, done.request_counts.failed) == (80, 0)
            outputs = await read_lines(svc.client, done.output_file_id)
            got = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in outputs}
            assert got == expected and len(outputs) == 80
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)


async def test_files_are_stored_verbatim_and_a_batch_needs_a_string_input_file_id(redis_url) -> None:
    async with openai_service(redis_url, None) as svc:
        for data in (b'{"a":1}', b'{"a":1}\r\n{"b":2}\r\n', b'\n{"a":1}\n\n  \n{"b":2}\n\n', "{\"é\":1}\n".encode()):
            created = await svc.client.files.create(file=("f.jsonl", io.BytesIO(data)), purpose="batch")
            assert created.bytes == len(data), data
            assert (await svc.client.files.retrieve(created.id)).bytes == len(data)
            assert (await svc.client.files.content(created.id)).content == data
        try:
            await svc.client.files.create(file=("f.jsonl", io.BytesIO(b"\n \r\n\n")), purpose="batch")
            raise AssertionError("a file of blank lines was accepted")
        except openai.BadRequestError as e:
            assert e.param == "file" and "no requests" in e.body["message"]

        for body, message in (({}, "input_file_id: required"),
                              ({"input_file_id": 5}, "input_file_id: must be a string"),
                              ({"input_file_id": "file-nope"}, "input_file_id: no such file: 'file-nope'")):
            try:
                await svc.client.post("/batches", cast_to=object,
                                      body={"endpoint": CHAT, "completion_window": "24h", **body})
                raise AssertionError(f"{body} was accepted")
            except openai.BadRequestError as e:
                assert e.param == "input_file_id" and e.body["message"].startswith(message), e.body
        try:
            await svc.client.batches.create(input_file_id=await upload(svc.client, [json.dumps(chat_line(0))]),
                                            endpoint=CHAT, completion_window="24h", metadata={"k": 5})
            raise AssertionError("metadata with a number was accepted")
        except openai.BadRequestError as e:
            assert e.param == "metadata.k"


async def test_a_batch_with_no_line_that_can_run_fails_and_lists_why(redis_url) -> None:
    """As OpenAI's validation fails a batch: `errors` names each bad line, the error file holds them all, and the
    one callback is batch.failed."""
    receiver = await Receiver(SECRET).start()
    # With no worker the model is not checked; a duplicate needs a good line before it.
    left_out = ("a model not served", "duplicate custom_id")
    bad = [line for name, line in BAD_LINES.items() if name not in left_out]
    async with openai_service(redis_url, None, batch_poll_interval_s=0.1, **webhook_settings()) as svc:
        batch = await svc.client.batches.create(input_file_id=await upload(svc.client, bad), endpoint=CHAT,
                                                completion_window="24h", extra_body={"webhook": {"url": receiver.url}})
        batch = await wait_batch(svc.client, batch.id, {"completed", "failed", "expired", "cancelled"})
        assert batch.status == "failed" and batch.failed_at and batch.in_progress_at is None
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (8, 0, 8)
        codes = [code for name, code in zip(BAD_LINES, EXPECTED_CODES) if name not in left_out]
        assert [(e.code, e.line) for e in batch.errors.data] == list(zip(codes, range(1, 9)))
        assert [e.param for e in batch.errors.data][:3] == [None, "custom_id", "custom_id"]
        assert batch.errors.data[5].message.startswith("line 6: ") and "temperature" in batch.errors.data[5].message
        assert batch.output_file_id is None
        assert [line_error(e)["code"] for e in await read_lines(svc.client, batch.error_file_id)] == codes
        payload = await the_callback(receiver, batch.id, "batch.failed")
        assert payload["data"]["status"] == "failed" and len(payload["data"]["errors"]["data"]) == 8
        await receiver.stop()



async def test_lines_with_lone_surrogates_or_a_reused_custom_id_fail_alone(redis_url) -> None:
    """Half a surrogate pair in a custom_id, a body key or a model (which JSON's escapes allow and Redis cannot
    hold) fails its line rather than holding the batch in validating; a custom_id already taken by an earlier
    line is a duplicate whether or not that line could run; NaN is no JSON."""
    wrong_url = {**chat_line(1), "custom_id": "taken", "url": "/v1/embeddings"}
    lines = [json.dumps({**chat_line(0), "custom_id": "\ud83d"}),
             json.dumps({**chat_line(1), "body": {**chat_line(1)["body"], "\ud800": 1}}),
             json.dumps({**chat_line(2), "body": {**chat_line(2)["body"], "model": "m\udc00"}}),
             json.dumps(wrong_url),
             json.dumps({**chat_line(3), "custom_id": "taken"}),
             json.dumps(chat_line(4))[:-1] + ', "extra": NaN}']
    async with openai_service(redis_url, None, batch_poll_interval_s=0.05) as svc:
        # (json.dumps escapes it; the openai client cannot send it at all.)
        body = json.dumps({"endpoint": CHAT, "completion_window": "24h", "input_file_id": "\ud800"})
        async with aiohttp.ClientSession() as http, http.post(f"{svc.url}/v1/batches", data=body,
                                                              headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
        assert error["param"] == "input_file_id" and "no such file" in error["message"]
        batch = await svc.client.batches.create(input_file_id=await upload(svc.client, lines), endpoint=CHAT,
                                                completion_window="24h")
        batch = await wait_batch(svc.client, batch.id, {"completed", "failed", "expired", "cancelled"})
        assert batch.status == "failed" and batch.request_counts.failed == 6
        errors = await read_lines(svc.client, batch.error_file_id)
        assert [line_error(e)["code"] for e in errors] == ["invalid_custom_id", "unsupported_parameter",
                                                           "invalid_value", "invalid_url", "duplicate_custom_id",
                                                           "invalid_json"]
        assert [e["custom_id"] for e in errors] == [None, "req-1", "req-2", "taken", "taken", None]
        assert "\\ud800" in line_error(errors[1])["message"] and "surrogate" in line_error(errors[2])["message"]


async def test_a_batch_whose_step_fails_holds_up_no_other_batch(redis_url, redis, caplog) -> None:
    """A batch the driver cannot move on (its hash damaged in Redis: an in-progress batch with no cursors) is tried
    again every round, logged once, and every other batch goes on meanwhile."""
    await redis.sadd(KEYS.batches_active, "batch_damaged")
    await redis.hset(KEYS.batch("batch_damaged"), mapping={"id": "batch_damaged", "status": "in_progress"})
    bad = [BAD_LINES["not json"], BAD_LINES["wrong url"]]
    with caplog.at_level(logging.INFO, logger="gateway.openai.batch_driver"):
        async with openai_service(redis_url, None, batch_poll_interval_s=0.05) as svc:
            batch = await svc.client.batches.create(input_file_id=await upload(svc.client, bad), endpoint=CHAT,
                                                    completion_window="24h")
            batch = await wait_batch(svc.client, batch.id, {"completed", "failed", "expired", "cancelled"})
            assert batch.status == "failed" and batch.request_counts.failed == 2
            await asyncio.sleep(0.3)  # more rounds meet the damaged batch
    faults = [r for r in caplog.records if "batch_damaged cannot go on" in r.getMessage()]
    assert len(faults) == 1 and faults[0].exc_info is not None, [r.getMessage() for r in caplog.records]
    assert await redis.sismember(KEYS.batches_active, "batch_damaged")


async def test_only_a_batch_that_has_not_ended_can_be_cancelled(redis_url) -> None:
    """No worker serves the model, so the requests wait in the batch lane until the cancel drops them."""
    async with openai_service(redis_url, None, batch_poll_interval_s=1) as svc:
        lines = [json.dumps(chat_line(i)) for i in range(5)]
        batch = await svc.client.batches.create(input_file_id=await upload(svc.client, lines), endpoint=CHAT,
                                                completion_window="24h")
        assert (await svc.client.batches.cancel(batch.id)).status == "cancelling"
        # A cancel already under way answers the same (the driver's next round comes a second later).
        assert (await svc.client.batches.cancel(batch.id)).status == "cancelling"
        await wait_batch(svc.client, batch.id, {"cancelled"})
        try:
            await svc.client.batches.cancel(batch.id)
            raise AssertionError("a cancelled batch was cancelled again")
        except openai.ConflictError as e:
            assert (e.status_code, e.code, e.param) == (409, "batch_not_cancellable", "batch_id")
            assert "has already ended (status cancelled)" in e.body["message"]
            assert e.response.headers["x-should-retry"] == "false"  # the client's retries could not change it

        # A batch with no line that can run fails.
        failed = await svc.client.batches.create(input_file_id=await upload(svc.client, ["not json"]), endpoint=CHAT,
                                                 completion_window="24h")
        failed = await wait_batch(svc.client, failed.id, {"failed", "cancelled", "completed"})
        assert failed.status == "failed"
        try:
            await svc.client.batches.cancel(failed.id)
            raise AssertionError("a failed batch was cancelled")
        except openai.ConflictError as e:
            assert e.code == "batch_not_cancellable" and "status failed" in e.body["message"]


async def test_a_batch_reads_its_input_file_even_when_it_is_deleted_at_once(redis_url, redis, tiny_model) -> None:
    """Upload, create, delete: the file is gone for its owner at once, but the batch keeps its lines until it has
    read them all, then they go too."""
    from scheduler.protocol.keys import Keys
    from worker.engine.engine import Engine

    keys = Keys()
    async with openai_service(redis_url, Engine(model=tiny_model(), max_num_seqs=4),
                              batch_poll_interval_s=0.1) as svc:
        file_id = await upload(svc.client, [json.dumps(chat_line(i)) for i in range(6)])
        batch = await svc.client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
        assert (await svc.client.files.delete(file_id)).deleted
        try:
            await svc.client.files.retrieve(file_id)
            raise AssertionError("a deleted file was still there")
        except openai.NotFoundError:
            pass
        batch = await wait_batch(svc.client, batch.id, {"completed", "failed", "expired", "cancelled"})
        assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 6, 0)
        assert sorted(o["custom_id"] for o in await read_lines(svc.client, batch.output_file_id)) == \
            [f"req-{i}" for i in range(6)]
        assert not await redis.exists(keys.file_lines(file_id), keys.file_readers(file_id))

        # A file not deleted keeps its lines after its batches, and its readers' set goes once they have read it.
        kept = await upload(svc.client, [json.dumps(chat_line(0))])
        batch = await svc.client.batches.create(input_file_id=kept, endpoint=CHAT, completion_window="24h")
        await wait_batch(svc.client, batch.id, {"completed"})
        assert await redis.llen(keys.file_lines(kept)) == 1 and not await redis.scard(keys.file_readers(kept))


async def test_error_file_lines_count_blank_lines_and_take_the_online_codes(redis_url, tiny_model) -> None:
    """Blank lines are skipped but numbered as in the user's file; a request the worker refuses (a prompt longer
    than the context) gets the online route's code, and every error message starts with its line."""
    from worker.engine.engine import Engine

    too_long = {**chat_line(2), "body": {**chat_line(2)["body"],
                                         "messages": [{"role": "user", "content": "x" * 2000}]}}
    over = {**chat_line(3), "body": {**chat_line(3)["body"], "max_completion_tokens": 100_000}}
    del over["body"]["max_tokens"]
    # Within the context alone, past it with the prompt: refused by the worker, which names `max_tokens`.
    over_with_prompt = {**chat_line(4), "body": {**over["body"], "max_completion_tokens": 100,
                                                 "messages": [{"role": "user", "content": "x" * 200}]}}
    data = "\r\n".join(["", json.dumps(chat_line(0)), "", json.dumps(too_long), "  ", "not json",
                        json.dumps(chat_line(1)), "", json.dumps(over), json.dumps(over_with_prompt), ""]).encode()
    async with openai_service(redis_url, Engine(model=tiny_model(), max_num_seqs=4, max_model_len=256),
                              batch_poll_interval_s=0.1) as svc:
        upload_id = (await svc.client.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch")).id
        batch = await svc.client.batches.create(input_file_id=upload_id, endpoint=CHAT, completion_window="24h")
        batch = await wait_batch(svc.client, batch.id, {"completed", "failed", "expired", "cancelled"})
        assert batch.status == "completed"
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (6, 2, 4)
        assert [o["custom_id"] for o in await read_lines(svc.client, batch.output_file_id)] == ["req-0", "req-1"]
        errors = await read_lines(svc.client, batch.error_file_id)
        assert [(e["custom_id"], line_error(e)["code"]) for e in errors] == \
            [("req-2", "context_length_exceeded"), (None, "invalid_json"), ("req-3", "context_length_exceeded"),
             ("req-4", "context_length_exceeded")]
        # Refused as it was enqueued (past the context the workers report), or by the worker as it ran: named as
        # the line named it.
        for refused in errors[2:]:
            assert line_error(refused)["param"] == "max_completion_tokens", refused
            assert "max_tokens" not in line_error(refused)["message"], refused
        assert errors[3]["response"]["request_id"] == f"{batch.id}-9"  # it ran: the worker refused it
        assert line_error(errors[0])["message"].startswith("line 4: messages: ")
        assert line_error(errors[1])["message"].startswith("line 6: ")
        # The request that ran and failed has the answer the online route gives it; the line that is no request
        # has an error of its own.
        assert errors[0]["response"]["status_code"] == 400 and errors[0]["response"]["request_id"] == f"{batch.id}-3"
        assert errors[0]["response"]["body"]["error"]["type"] == "invalid_request_error"
        assert errors[0]["response"]["body"]["error"]["param"] == "messages" and errors[1]["response"] is None
        assert (await svc.client.files.content(upload_id)).content == data

        # A byte-order mark before the first line, as some editors save UTF-8: kept in the file, not in the JSON.
        for first in ("", json.dumps(chat_line(0))):
            marked = ("\ufeff" + "\n".join([first, json.dumps(chat_line(1))]) + "\n").encode()
            upload_id = (await svc.client.files.create(file=("m.jsonl", io.BytesIO(marked)), purpose="batch")).id
            batch = await svc.client.batches.create(input_file_id=upload_id, endpoint=CHAT, completion_window="24h")
            batch = await wait_batch(svc.client, batch.id, {"completed", "failed", "expired", "cancelled"})
            assert (batch.status, batch.request_counts.failed, batch.error_file_id) == ("completed", 0, None)
            assert batch.request_counts.completed == (2 if first else 1)
            assert (await svc.client.files.content(upload_id)).content == marked
