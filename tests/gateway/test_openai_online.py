"""The OpenAI routes against a real gateway, a real worker and the real `openai` client."""

from __future__ import annotations

import asyncio
import random
import time

import openai
import pytest
import msgpack

from scheduler.params import SamplingParams
from scheduler.protocol.keys import Keys
from tests.harness.openai_support import MODEL_NAME, openai_service
from tests.harness.worker_harness import WAIT_S, HeldReplies, wait_until

KEYS = Keys()
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name three colours"}]


@pytest.fixture
def model(tiny_model) -> str:
    return tiny_model()


@pytest.fixture
def engine(model):
    from worker.engine.engine import Engine

    return Engine(model=model, max_num_seqs=8)


def offline(model: str, prompt: str | list[int], max_tokens: int):
    from worker.engine.engine import Engine

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Engine(model=model, max_num_seqs=8).generate([prompt], params)[0]


def chat_prompt_ids(model: str) -> list[int]:
    from transformers import AutoTokenizer

    from worker.engine.prompt_input import apply_chat_template

    return apply_chat_template(AutoTokenizer.from_pretrained(model), MESSAGES)


async def wait_models(client: openai.AsyncOpenAI) -> list[str]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        names = [m.id async for m in client.models.list()]
        if names:
            return names
        await asyncio.sleep(0.1)
    return []


async def test_models_completions_and_chat_match_the_offline_engine(redis_url, model, engine) -> None:
    expected_text = offline(model, "The quick brown fox", 8)
    expected_chat = offline(model, chat_prompt_ids(model), 10)
    async with openai_service(redis_url, engine) as svc:
        assert await wait_models(svc.client) == [MODEL_NAME]

        completion = await svc.client.completions.create(model=MODEL_NAME, prompt="The quick brown fox",
                                                         max_tokens=8, **GREEDY)
        assert completion.object == "text_completion"
        assert completion.choices[0].text == expected_text.text
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage.completion_tokens == 8
        assert completion.usage.total_tokens == completion.usage.prompt_tokens + 8

        chat = await svc.client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, **GREEDY)
        assert chat.choices[0].message.role == "assistant"
        assert chat.choices[0].message.content == expected_chat.text
        assert chat.choices[0].finish_reason == "length"
        assert chat.usage.prompt_tokens == len(chat_prompt_ids(model))

        stream = await svc.client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=10, stream=True,
            # include_obfuscation: false is what OpenAI advises to save bandwidth; carpool never pads chunks.
            stream_options={"include_usage": True, "include_obfuscation": False}, **GREEDY)
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == expected_chat.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
        # With include_usage, every chunk before the last says `usage: null`, as OpenAI's do.
        assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])
        assert chat.choices[0].message.refusal is None and "refusal" in chat.choices[0].message.model_fields_set

        stream = await svc.client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=8,
                                                     stream=True, **GREEDY)
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].text for c in chunks) == expected_text.text
        assert not any("usage" in c.model_fields_set for c in chunks)  # usage was not asked for


async def test_n_choices_logprobs_lanes_and_refusals(redis_url, model, engine, redis) -> None:
    async with openai_service(redis_url, engine) as svc:
        three = await svc.client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, n=3,
                                                         temperature=1.0, seed=7, service_tier="flex")
        assert [c.index for c in three.choices] == [0, 1, 2]
        assert 3 <= three.usage.completion_tokens <= 18
        assert {await redis.hget(KEYS.job(f"{three.id}-{i}"), "lane") for i in range(3)} == {b"batch"}
        seeds = set()
        for i in range(3):
            spec = msgpack.unpackb(await redis.hget(KEYS.job(f"{three.id}-{i}"), "spec"))
            seeds.add(spec["params"]["seed"])
        assert len(seeds) == 3 and 7 in seeds

        with_logprobs = await svc.client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY)
        content = with_logprobs.choices[0].logprobs.content
        assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)

        with pytest.raises(openai.BadRequestError) as refused:
            await svc.client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                                     tools=[{"type": "function", "function": {"name": "f"}}])
        assert refused.value.status_code == 400 and refused.value.param == "tools"
        assert "tools" in refused.value.message
        # Clients that send the tool fields with every request, asking for none, are answered.
        no_tools = await svc.client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                                            tools=[], tool_choice="none", parallel_tool_calls=False,
                                                            **GREEDY)
        assert no_tools.choices[0].message.tool_calls is None and no_tools.usage.completion_tokens == 2
        with pytest.raises(openai.BadRequestError) as refused:
            await svc.client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tool_choice="auto")
        assert refused.value.param == "tool_choice" and refused.value.code == "unsupported_parameter"
        with pytest.raises(openai.BadRequestError) as refused:
            await svc.client.chat.completions.create(model=5, messages=MESSAGES)  # type: ignore[arg-type]
        assert refused.value.param == "model" and "got integer" in refused.value.message
        with pytest.raises(openai.BadRequestError) as refused:
            await svc.client.completions.create(model=MODEL_NAME, prompt="x", extra_body={"beam_width": 2})
        assert refused.value.param == "beam_width"
        with pytest.raises(openai.BadRequestError) as refused:
            await svc.client.completions.create(model=MODEL_NAME, prompt="x", temperature=-1)
        assert refused.value.param == "temperature"
        with pytest.raises(openai.BadRequestError) as refused:
            await svc.client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=2.5)
        assert refused.value.param == "temperature" and "must be in [0, 2]" in refused.value.message
        with pytest.raises(openai.NotFoundError) as missing:
            await svc.client.completions.create(model="no-such-model", prompt="x")
        assert missing.value.code == "model_not_found"


async def test_with_no_worker_running_a_request_waits_only_for_a_model_the_workers_served(redis_url, engine,
                                                                                          redis) -> None:
    """Between workers (a restart, a scale-to-zero) a request for the deployment's model waits in its lane; one for
    another name is a 404 rather than a job some other model would answer under that name."""
    async with openai_service(redis_url, engine) as svc:
        await svc.client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1)
    async with openai_service(redis_url, None) as svc:
        with pytest.raises(openai.NotFoundError) as missing:
            await svc.client.completions.create(model="typo", prompt="x", max_tokens=1)
        assert missing.value.code == "model_not_found" and missing.value.param == "model"
        assert "no worker is running now" in missing.value.message and MODEL_NAME in missing.value.message
        waiting = asyncio.create_task(svc.client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1))
        await wait_until(lambda: redis.xlen(KEYS.lane("standard")), "the request waiting in its lane")
        waiting.cancel()
        # A model last heard of longer ago than a queued job may wait is forgotten: with no name left, any waits.
        await redis.hset(KEYS.models, MODEL_NAME, repr(time.time() - 8 * 24 * 3600))
        waiting = asyncio.create_task(svc.client.completions.create(model="typo", prompt="x", max_tokens=1))

        async def both_in_lane() -> bool:
            return await redis.xlen(KEYS.lane("standard")) == 2

        await wait_until(both_in_lane, "the second request waiting in its lane too")
        waiting.cancel()
        assert not await redis.hexists(KEYS.models, MODEL_NAME)


async def test_a_disconnected_stream_cancels_its_job(redis_url, engine, redis) -> None:
    async with openai_service(redis_url, engine) as svc:
        stream = await svc.client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1500,
                                                          stream=True, **GREEDY)
        chunks = 0
        async for chunk in stream:
            chunks += 1
            if chunks == 3:
                break
        await stream.close()
        await assert_cancelled_and_released(redis, engine, KEYS.job(f"{chunk.id}-0"))


async def assert_cancelled_and_released(redis, engine, job: str | bytes) -> None:
    """The job ends cancelled, and no compute is orphaned: the engine dropped its sequence and freed its blocks."""
    deadline = time.monotonic() + 20
    while (await redis.hget(job, "status")) not in (b"cancelled", b"succeeded") and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert await redis.hget(job, "status") == b"cancelled"
    await wait_until(lambda: engine.stats().num_running == 0 and engine.stats().num_kv_blocks_used == 0,
                     "the cancelled job's sequence and blocks are released")


async def test_a_client_hanging_up_on_a_running_non_streaming_request_cancels_its_job(redis_url, engine,
                                                                                      redis) -> None:
    """The job sends a token event every step, so its waiter is never idle: the hang-up is still seen."""
    async with openai_service(redis_url, engine) as svc:
        call = asyncio.create_task(svc.client.with_options(max_retries=0).chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=1900, **GREEDY))
        job = None

        async def generating() -> bool:
            nonlocal job
            job = next(iter([k async for k in redis.scan_iter(match=KEYS.job("chatcmpl-*"))]), None)
            return job is not None and await redis.hget(job, "status") == b"running"

        await wait_until(generating, "the request's job runs")
        call.cancel()  # the client hangs up (the openai client closes its connection)
        with pytest.raises(asyncio.CancelledError):
            await call
        assert job is not None
        await assert_cancelled_and_released(redis, engine, job)


async def test_a_job_cancelled_by_someone_else_is_a_409_the_client_does_not_retry(redis_url, engine, redis) -> None:
    """The openai client retries a 409 by default: without `x-should-retry: false` it would enqueue the request
    again after each cancel."""
    import aiohttp

    async with openai_service(redis_url, engine) as svc:
        client = svc.client.with_options(max_retries=2)
        call = asyncio.create_task(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                                                  max_tokens=1900, **GREEDY))

        async def jobs() -> list[bytes]:
            return [k async for k in redis.scan_iter(match=KEYS.job("chatcmpl-*"))]

        async def running() -> bool:
            found = await jobs()
            return bool(found) and await redis.hget(found[0], "status") == b"running"

        await wait_until(running, "the request's job runs")
        (job,) = await jobs()
        async with aiohttp.ClientSession() as http:
            async with http.delete(f"{svc.url}/v1/jobs/{job.decode().removeprefix(KEYS.job(''))}") as resp:
                assert resp.status == 202
        with pytest.raises(openai.ConflictError) as cancelled:
            await call
        assert cancelled.value.code == "cancelled"
        assert cancelled.value.response.headers["x-should-retry"] == "false"
        assert await jobs() == [job]  # not enqueued again


async def test_a_full_lane_is_a_429_with_retry_after_and_a_hung_up_request_cancels(redis_url, redis) -> None:
    async with openai_service(redis_url, None, max_lane_depth={"interactive": 1}) as svc:
        first = asyncio.create_task(svc.client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                                                       max_tokens=4))
        deadline = time.monotonic() + 10
        while not await redis.xlen(KEYS.lane("interactive")) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with pytest.raises(openai.RateLimitError) as full:
            await svc.client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4)
        assert full.value.response.headers["Retry-After"] == "2"
        assert full.value.code == "lane_full"
        first.cancel()
        ids = [k.decode() async for k in redis.scan_iter(match=KEYS.job("chatcmpl-*"))]
        assert len(ids) == 1
        deadline = time.monotonic() + 10
        while await redis.hget(ids[0], "status") != b"cancelled" and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert await redis.hget(ids[0], "status") == b"cancelled"


async def test_choices_are_admitted_to_a_lane_all_or_none(redis_url, redis) -> None:
    """More choices than the lane ever holds is a 400 naming `n`; more than it holds now, a 429 that enqueued
    none of them (no choice left behind as a cancelled job)."""
    async with openai_service(redis_url, None, max_lane_depth={"standard": 2}) as svc:
        with pytest.raises(openai.BadRequestError) as too_many:
            await svc.client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=3, n=3)
        assert (too_many.value.code, too_many.value.param) == ("lane_depth_limit", "n")
        assert "at most n=2" in too_many.value.message
        first = asyncio.create_task(svc.client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=3))
        deadline = time.monotonic() + 10
        while not await redis.xlen(KEYS.lane("standard")) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with pytest.raises(openai.RateLimitError) as full:
            await svc.client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=3, n=2)
        assert full.value.code == "lane_full" and "no room for 2 jobs (1 job, at most 2)" in full.value.message
        first.cancel()
        assert len([k async for k in redis.scan_iter(match=KEYS.job("cmpl-*"))]) == 1  # the first request's only


async def test_logprobs_name_tokens_as_openai_does(redis_url, model, engine) -> None:
    async with openai_service(redis_url, engine) as svc:
        raw = await svc.client.chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=12, logprobs=True, top_logprobs=3, **GREEDY)
        assert "Infinity" not in raw.text  # -inf is OpenAI's -9999.0: strict JSON parsers read every answer
        chat = raw.parse()
        content = chat.choices[0].logprobs.content
        assert len(content) == 12
        # Each token is its own text, or bytes:\xNN... when it is part of a character; its bytes rebuild the text
        # (special tokens, which the text leaves out, show as themselves).
        from transformers import AutoTokenizer

        special = set(AutoTokenizer.from_pretrained(model).all_special_tokens)
        assert b"".join(bytes(t.bytes) for t in content if t.token not in special).decode("utf-8", "replace") == \
            chat.choices[0].message.content
        for t in content:
            assert t.token == (bytes(t.bytes).decode() if _is_utf8(bytes(t.bytes))
                               else "bytes:" + "".join(f"\\x{b:02x}" for b in t.bytes))
            assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy: the top token
            assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
            assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert not any(t.token.startswith("token_id:") for t in content)

        completion = await svc.client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=6,
                                                         logprobs=2, **GREEDY)
        lp = completion.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert all(len(top) <= 2 and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs))
        # The sampled token is always among them (up to logprobs + 1 entries), as in OpenAI's legacy completions.
        sampled = await svc.client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=12,
                                                      logprobs=1, temperature=1.0, seed=3)
        lp = sampled.choices[0].logprobs
        assert all(top[token] == logprob and 1 <= len(top) <= 2
                   for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
        assert any(len(top) == 2 for top in lp.top_logprobs)  # some sampled token was not the most likely
        only = await svc.client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=3, logprobs=0, **GREEDY)
        assert [list(top) for top in only.choices[0].logprobs.top_logprobs] == \
            [[token] for token in only.choices[0].logprobs.tokens]


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


async def test_chat_without_max_tokens_gets_the_rest_of_the_context_and_too_long_a_prompt_is_a_400(
        redis_url, model) -> None:
    from worker.engine import Engine

    prompt_len = len(chat_prompt_ids(model))
    context = prompt_len + 20
    async with openai_service(redis_url, Engine(model=model, max_num_seqs=4, max_model_len=context)) as svc:
        await wait_models(svc.client)
        chat = await svc.client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY)
        assert chat.usage.prompt_tokens == prompt_len
        assert chat.usage.completion_tokens == context - prompt_len and chat.choices[0].finish_reason == "length"

        too_long = [{"role": "user", "content": "many words " * context}]
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                await svc.client.chat.completions.create(model=MODEL_NAME, messages=too_long, stream=stream)
            assert refused.value.status_code == 400
            assert (refused.value.param, refused.value.code) == ("messages", "context_length_exceeded")
        with pytest.raises(openai.BadRequestError) as refused:
            await svc.client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=21)
        assert (refused.value.param, refused.value.code) == ("max_tokens", "context_length_exceeded")
        # The whole context or more: no prompt fits beside it, as the gateway itself judges.
        for route, body in ((svc.client.chat.completions, {"messages": MESSAGES}),
                            (svc.client.completions, {"prompt": "hi"})):
            with pytest.raises(openai.BadRequestError) as refused:
                await route.create(model=MODEL_NAME, max_tokens=context, **body)  # type: ignore[attr-defined]
            assert (refused.value.param, refused.value.code) == ("max_tokens", "context_length_exceeded")
        with pytest.raises(openai.BadRequestError) as refused:
            await svc.client.completions.create(model=MODEL_NAME, prompt=list(range(3, 3 + context)))
        assert (refused.value.param, refused.value.code) == ("prompt", "context_length_exceeded")
        # The limit is named as the request gave it, whether the worker (streamed or not) or the gateway judges it.
        for limit, stream in ((21, False), (21, True), (context, False)):
            with pytest.raises(openai.BadRequestError) as refused:
                await svc.client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=stream,
                                                         max_completion_tokens=limit)
            assert (refused.value.param, refused.value.code) == ("max_completion_tokens", "context_length_exceeded")
            assert "max_tokens" not in refused.value.message, refused.value.message


async def test_a_chat_stream_starts_with_its_first_token_even_when_that_token_has_no_text_yet(redis_url, model) -> None:
    """A byte-level model's first token may be the first byte of a character: its text waits for the next token,
    but the stream, and with it the chunk naming the role, starts at once. The worker's replies are held after
    the first, so the second token cannot have been computed when that chunk arrives."""
    from transformers import AutoTokenizer

    from worker.engine.engine import Engine
    from worker.engine.prompt_input import apply_chat_template

    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = random.Random(0)
    candidates = [[{"role": "user", "content": "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ")
                                                         for _ in range(rng.randint(3, 16)))}] for _ in range(300)]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    firsts = Engine(model=model, max_num_seqs=8).generate(
        [apply_chat_template(tokenizer, m) for m in candidates], one)
    # A byte that starts a multi-byte character (the byte-level tokenizer's ids are the byte values).
    starts = [m for m, c in zip(candidates, firsts) if 0xC2 <= c.token_ids[0] <= 0xF4]
    assert starts, "no prompt's first token starts a character"
    messages = starts[0]
    expected = offline(model, apply_chat_template(tokenizer, messages), 6)
    runner = HeldReplies(Engine(model=model, max_num_seqs=8))
    # No heartbeat while the test waits: one would start the stream too.
    async with openai_service(redis_url, runner, sse_heartbeat_s=2 * WAIT_S) as svc:
        await runner.hold(passes=1)
        stream = await svc.client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6,
                                                          stream=True, **GREEDY)
        chunks = aiter(stream)
        first = await asyncio.wait_for(anext(chunks), WAIT_S)
        assert first.choices[0].delta.role == "assistant" and not first.choices[0].delta.content
        await runner.release()
        rest = [c async for c in chunks]
    assert "".join(c.choices[0].delta.content or "" for c in rest if c.choices) == expected.text


async def test_wrong_types_and_openai_limits_are_400s_naming_the_parameter(redis_url, redis) -> None:
    """Refused before any job exists, with OpenAI's limits: `stop` up to 4 sequences, `metadata` up to 16 string
    pairs (keys up to 64 characters, values up to 512), `user` and a message's `name` strings."""
    long_key, long_value = "k" * 65, "v" * 513
    cases = [
        ({"stop": 5}, "stop", "must be a string or a list of strings"),
        ({"stop": {"a": 1}}, "stop", "must be a string or a list of strings"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 stop sequences"),
        ({"extra_body": {"stop_token_ids": 5}}, "stop_token_ids", "must be a list of integers"),
        ({"max_tokens": 3, "extra_body": {"min_tokens": 10}}, "min_tokens", "must not exceed max_tokens (10 > 3)"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "must be >= 1"),
        ({"metadata": "x"}, "metadata", "must be an object"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16 keys"),
        ({"metadata": {long_key: "v"}}, "metadata", "keys are at most 64 characters"),
        ({"metadata": {"k": long_value}}, "metadata.k", "at most 512 characters"),
        ({"metadata": {"k": 5}}, "metadata.k", "must be a string"),
        ({"user": 5}, "user", "must be a string"),
        ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages[0].name", "must be a string"),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "a non-empty list of text parts"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text", "required"),
    ]
    async with openai_service(redis_url, None) as svc:
        for args, param, words in cases:
            create = {"model": MODEL_NAME, "messages": MESSAGES, **args}
            with pytest.raises(openai.BadRequestError) as refused:
                await svc.client.chat.completions.create(**create)
            error = refused.value
            assert (error.status_code, error.param, error.code) == (400, param, "invalid_value"), (args, error)
            message = error.body["message"]
            assert message.startswith(f"{param}: ") and words in message, (args, message)
            assert message.count(words) == 1 and message.count(f"{param}:") == 1, message
        with pytest.raises(openai.BadRequestError) as refused:
            await svc.client.completions.create(model=MODEL_NAME, prompt="x", stop=5)
        assert refused.value.param == "stop"
        image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
        with pytest.raises(openai.BadRequestError) as refused:
            await svc.client.chat.completions.create(model=MODEL_NAME, messages=[
                {"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}])
        assert (refused.value.param, refused.value.code) == ("messages[0].content[1]", "unsupported_parameter")
        # The limits themselves are accepted (and reach the queue).
        ok = asyncio.create_task(svc.client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi", "name": "ann"}], user="u-1", max_tokens=2,
            stop=["a", "b", "c", "d"], metadata={"k" * 64: "v" * 512, **{str(i): "v" for i in range(15)}}))
        await wait_until(lambda: redis.xlen(KEYS.lane("interactive")), "the request's job is queued")
        ok.cancel()


async def test_refused_openai_requests_count_as_rejected_submissions(redis_url, engine) -> None:
    import aiohttp

    from tests.harness.telemetry_support import value

    async with openai_service(redis_url, engine) as svc:
        assert await wait_models(svc.client) == [MODEL_NAME]  # a model no worker serves is then a 404
        for call in (svc.client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "bogus", "content": "x"}]),
                     svc.client.completions.create(model="no-such-model", prompt="x")):
            with pytest.raises(openai.APIStatusError):
                await call
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{svc.url}/v1/chat/completions", data=b"{nope",
                                 headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 400
            async with http.get(f"{svc.url}/metrics") as resp:
                text = await resp.text()
    assert value(text, "carpool_jobs_rejected_total", carpool_reject_reason="invalid") == 3
