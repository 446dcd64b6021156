"""A stream whose worker is SIGKILLed mid-answer: the job resumes on another worker, and every client reads its
text once — the `openai` client's stream and the job's own event stream alike."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp

from scheduler.params import SamplingParams
from scheduler.protocol.keys import Keys
from tests.harness.openai_support import MODEL_NAME, openai_service, start_worker

KEYS = Keys()
MESSAGES = [{"role": "user", "content": "tell me a long story"}]
MAX_TOKENS = 1000


def offline_text(model: str) -> str:
    from transformers import AutoTokenizer

    from worker.engine import Engine
    from worker.engine.prompt_input import apply_chat_template

    prompt = apply_chat_template(AutoTokenizer.from_pretrained(model), MESSAGES)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return Engine(model=model, max_num_seqs=8).generate([prompt], params)[0].text


async def events_text(url: str, job_id: str) -> str:
    """The text of GET /v1/jobs/{id}/events (from the start, then live until final), token events joined."""
    text = []
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/v1/jobs/{job_id}/events") as resp:
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    event = json.loads(line[len("data: "):])
                    if event["type"] == "token":
                        text.append(event["text"])
    return "".join(text)


async def test_a_stream_resumed_on_another_worker_reads_each_token_once(redis_url, redis, tiny_model,
                                                                        tmp_path) -> None:
    model = tiny_model()
    expected = offline_text(model)
    first = start_worker(redis_url, model, "first", tmp_path / "first.log")
    second = None
    try:
        async with openai_service(redis_url, None) as svc:
            stream = await svc.client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
            pieces: list[str] = []
            job_id = None
            events: asyncio.Task[str] | None = None
            async for chunk in stream:
                job_id = f"{chunk.id}-0"
                if events is None:  # the job's own event stream, read live across the resume
                    events = asyncio.create_task(events_text(svc.url, job_id))
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
                if second is None:
                    # Frozen at its first chunk, the worker then runs in 10 ms slices until the job has a
                    # checkpoint, and is killed frozen: mid-answer by construction, however fast it decodes.
                    first.send_signal(signal.SIGSTOP)
                    deadline = time.monotonic() + 240
                    while not await redis.hget(KEYS.job(job_id), "checkpoint"):
                        assert time.monotonic() < deadline, "no checkpoint"
                        first.send_signal(signal.SIGCONT)
                        await asyncio.sleep(0.01)
                        first.send_signal(signal.SIGSTOP)
                    assert await redis.hget(KEYS.job(job_id), "status") == b"running"
                    first.send_signal(signal.SIGKILL)
                    first.wait()
                    second = start_worker(redis_url, model, "second", tmp_path / "second.log")
            assert job_id is not None and second is not None
            record_resumed = await redis.hget(KEYS.job(job_id), "resumed_from")
            assert record_resumed is not None and int(record_resumed) > 0, (tmp_path / "second.log").read_text()
            assert "".join(pieces) == expected
            assert events is not None and await events == expected
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)


async def test_a_stream_whose_pubsub_connection_drops_reads_its_gap_from_the_log(redis_url, redis, tiny_model) -> None:
    """Redis drops the gateway's pub/sub connection mid-stream (as at a Redis restart): the events published
    meanwhile are lost, read back from the job's event log, and the stream still carries the whole answer."""
    from worker.engine.engine import Engine

    model = tiny_model()
    expected = offline_text(model)
    async with openai_service(redis_url, Engine(model=model, max_num_seqs=2)) as svc:
        stream = await svc.client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        pieces: list[str] = []
        dropped = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                if len(pieces) in (3, 12):  # twice, while tokens keep coming
                    dropped += await redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    assert dropped >= 2 and "".join(pieces) == expected
