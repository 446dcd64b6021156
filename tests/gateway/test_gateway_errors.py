"""Every error in the documented JSON shape, and no input a 500: surrogates, aiohttp's own errors, Redis down."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient

from gateway.app import init_app
from gateway.cli.embedded_redis import EmbeddedRedis
from gateway.config import GatewayConfig
from scheduler.protocol.keys import Keys
from tests.harness.gateway_process import gateway_process
from tests.harness.gateway_server import GatewayTestServer

KEYS = Keys()


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[TestClient]:
    config = GatewayConfig(redis_url=redis_url, no_webhooks=True, max_body_bytes=64 * 1024)
    async with TestClient(GatewayTestServer(init_app(config))) as client:
        yield client


def assert_error_shape(body: Any, kind: str) -> None:
    assert set(body) == {"error"}, body
    assert body["error"]["type"] == kind, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "\ud800"}, "prompt"),
        ({"prompt": "hi", "params": {"stop": ["ok", "\udfff"]}}, "params.stop[1]"),
        ({"prompt": "hi", "metadata": {"who": {"name": "a\ud83d"}}}, "metadata.who.name"),
        ({"prompt": "hi", "metadata": {"\ud800": 1}}, "metadata"),
        ({"messages": [{"role": "user", "content": "\ud800\ud800"}]}, "messages[0].content"),
        ({"prompt": "hi", "reply_to": "replies:\udc80"}, "reply_to"),
        ({"prompt": "hi", "metadata": {"n": 2**64}}, "metadata.n"),
        ({"prompt_token_ids": [1, 2**70]}, "prompt_token_ids[1]"),
        ({"prompt": "hi", "metadata": {"deep": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}},
         "metadata.deep[0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0]"),
    ],
)
async def test_values_json_allows_but_msgpack_cannot_carry_are_400_naming_the_field(
    client: TestClient, redis: aioredis.Redis, body: dict[str, Any], field: str
) -> None:
    resp = await client.post("/v1/jobs", data=json.dumps(body), headers={"Content-Type": "application/json"})
    reply = await resp.json()
    assert resp.status == 400, reply
    assert_error_shape(reply, "invalid_request")
    assert reply["error"]["field"] == field
    assert sum([await redis.xlen(stream) for stream in KEYS.lanes()]) == 0


async def test_a_body_nested_past_the_parser_is_400(client: TestClient) -> None:
    resp = await client.post("/v1/jobs", data=b'{"prompt": "x", "metadata": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
                             headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert (await resp.json())["error"]["field"] == "body"


async def test_an_integer_of_too_many_digits_is_400_in_the_senders_terms(client: TestClient) -> None:
    """Not Python's advice to raise a limit of the server's process."""
    for route, body in (("/v1/jobs", b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}"),
                        ("/v1/completions", b'{"model": "m", "prompt": "x", "seed": ' + b"9" * 5000 + b"}")):
        resp = await client.post(route, data=body, headers={"Content-Type": "application/json"})
        message = (await resp.json())["error"]["message"]
        assert resp.status == 400 and "too many digits" in message and "sys." not in message, message


async def test_nan_and_infinity_are_no_json(client: TestClient) -> None:
    """Python's parser takes NaN and Infinity; no JSON holds them, and a body with one is refused as not JSON,
    whatever field it is in (one a job would ignore too)."""
    for route, body in (("/v1/jobs", b'{"prompt": "x", "metadata": {"score": NaN}}'),
                        ("/v1/completions", b'{"model": "m", "prompt": "x", "temperature": Infinity}')):
        resp = await client.post(route, data=body, headers={"Content-Type": "application/json"})
        error = (await resp.json())["error"]
        assert resp.status == 400 and "is not JSON (numbers are finite)" in error["message"], error
        assert error.get("field", error.get("param")) == "body"


async def test_aiohttp_errors_answer_in_the_json_shape(client: TestClient) -> None:
    resp = await client.get("/no/such/route")
    assert resp.status == 404
    assert_error_shape(await resp.json(), "not_found")

    resp = await client.put("/v1/jobs", json={"prompt": "x"})
    assert resp.status == 405
    assert "POST" in resp.headers["Allow"]
    assert_error_shape(await resp.json(), "method_not_allowed")
    assert (await resp.json())["error"]["message"].startswith("Method PUT is not allowed on /v1/jobs; allowed: ")

    resp = await client.post("/v1/jobs", json={"prompt": "x" * 100_000})
    assert resp.status == 413
    assert_error_shape(await resp.json(), "payload_too_large")
    assert "limit of 65536 bytes" in (await resp.json())["error"]["message"]


@pytest.mark.parametrize(
    ("params", "field", "words"),
    [
        ({"stop": 5}, "params.stop", "must be a string or a list of strings"),
        ({"stop": {"a": 1}}, "params.stop", "must be a string or a list of strings"),
        ({"stop": ["ok", 3]}, "params.stop", "must be a string or a list of strings"),
        ({"stop_token_ids": 5}, "params.stop_token_ids", "must be a list of integers"),
        ({"stop_token_ids": [1, "2"]}, "params.stop_token_ids", "must be a list of non-negative integers"),
        ({"min_tokens": 10, "max_tokens": 2}, "params.min_tokens", "must not exceed max_tokens (10 > 2)"),
        ({"temperature": "hot"}, "params.temperature", "must be a number"),
        ({"no_such": 1}, "params.no_such", "unknown sampling parameter"),
    ],
)
async def test_a_bad_sampling_parameter_is_400_naming_it(
    client: TestClient, redis: aioredis.Redis, params: dict[str, Any], field: str, words: str
) -> None:
    resp = await client.post("/v1/jobs", json={"prompt": "x", "params": params})
    reply = await resp.json()
    assert resp.status == 400, reply
    assert_error_shape(reply, "invalid_request")
    assert reply["error"]["field"] == field
    assert words in reply["error"]["message"] and field not in reply["error"]["message"]
    assert sum([await redis.xlen(stream) for stream in KEYS.lanes()]) == 0


async def test_params_that_are_not_a_map_are_400_naming_params(client: TestClient) -> None:
    resp = await client.post("/v1/jobs", json={"prompt": "x", "params": [1]})
    reply = await resp.json()
    assert resp.status == 400 and reply["error"] == {"type": "invalid_request", "field": "params",
                                                    "message": "must be a map"}


async def test_unknown_openai_routes_and_aiohttp_errors_there_answer_in_openai_shape(client: TestClient) -> None:
    for method, path in (("POST", "/v1/embeddings"), ("POST", "/v1/responses"), ("GET", "/v1/nothing/here")):
        resp = await client.request(method, path, json={})
        assert resp.status == 404
        assert await resp.json() == {"error": {"message": f"Invalid URL ({method} {path})",
                                               "type": "invalid_request_error", "param": None,
                                               "code": "unknown_url"}}

    resp = await client.get("/v1/chat/completions")
    assert resp.status == 405 and "POST" in resp.headers["Allow"]
    error = (await resp.json())["error"]
    assert error["code"] == "method_not_allowed" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("Method GET is not allowed on /v1/chat/completions; allowed: ")
    assert "POST" in error["message"]

    resp = await client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user",
                                                                                       "content": "x" * 100_000}]})
    assert resp.status == 413
    error = (await resp.json())["error"]
    assert error["code"] == "request_too_large"
    assert error["message"] == "The request body is larger than this server's limit of 65536 bytes"

    # carpool's own routes keep carpool's shape, with the same clear messages.
    resp = await client.get("/v1/jobs/a/b/c")
    assert resp.status == 404
    assert (await resp.json())["error"] == {"type": "not_found", "message": "Invalid URL (GET /v1/jobs/a/b/c)"}


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], str | None]:
    request = urllib.request.Request(f"{url}/v1/jobs", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read()), None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers.get("Retry-After")


def test_redis_down_or_restarted_is_a_json_503_with_retry_after(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", is_persistent=False).start()
    try:
        with gateway_process(server.url, tmp_path / "gateway.log", "--retry-after-s", "4") as gateway:
            assert _post(gateway.url, {"prompt": "before"})[0] == 202
            server.stop()
            status, body, retry_after = _post(gateway.url, {"prompt": "while down"})
            assert (status, retry_after) == (503, "4"), body
            assert_error_shape(body, "unavailable")
            with pytest.raises(urllib.error.HTTPError) as got:
                urllib.request.urlopen(f"{gateway.url}/v1/jobs/anything", timeout=60)
            assert got.value.code == 503
            assert_error_shape(json.loads(got.value.read()), "unavailable")

            server = EmbeddedRedis(tmp_path / "redis", port=server.port, is_persistent=False).start()
            statuses = []
            deadline = time.monotonic() + 30
            while not statuses or statuses[-1] != 202:
                assert time.monotonic() < deadline, statuses
                statuses.append(_post(gateway.url, {"prompt": "after the restart"})[0])
            assert set(statuses) <= {202, 503}, statuses
            assert "Traceback" not in gateway.log_text()
    finally:
        server.stop()


async def test_a_record_holding_bytes_from_before_values_were_checked_still_reads(
    client: TestClient, redis: aioredis.Redis
) -> None:
    import msgpack

    spec = msgpack.packb({"id": "old", "prompt": "x", "metadata": {"blob": b"\x00ok"}}, use_bin_type=True)
    await redis.hset(KEYS.job("old"), mapping={"id": "old", "status": "queued", "lane": "standard", "spec": spec})
    resp = await client.get("/v1/jobs/old")
    assert resp.status == 200
    assert (await resp.json())["metadata"] == {"blob": "\x00ok"}
