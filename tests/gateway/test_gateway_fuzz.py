"""Arbitrary JSON bodies, paths, queries and headers at every route of a real gateway process: never a 5xx.

Every error answer must also be in the documented shape, ``{"error": {"type", "message", ...}}``.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.openai.schema import KNOWN, Endpoint
from tests.harness.gateway_process import gateway_process

# Any code point, lone surrogates included (JSON's \ud800 escape can carry them).
ANY_TEXT = (st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
            | st.sampled_from(["\ud800", "ok\udfff", "\U0001f600"]))
FIELDS = ["v", "id", "prompt", "prompt_token_ids", "messages", "params", "lane", "priority", "deadline",
          "webhook", "reply_to", "metadata", "traceparent"]
PARAMS = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
          "min_tokens", "logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty"]
SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | ANY_TEXT | st.sampled_from(["interactive", "hi", "user"]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(ANY_TEXT | st.sampled_from(FIELDS + PARAMS + ["role", "content", "url"]), inner,
                                      max_size=4), max_leaves=12)
JOB_LIKE = st.fixed_dictionaries(
    {"prompt": st.sampled_from(["hello"]) | ANY_TEXT},
    optional={name: JSON for name in FIELDS if name != "prompt"} | {
        "params": st.dictionaries(st.sampled_from(PARAMS), JSON, max_size=4),
        "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "robot"]),
                                                    "content": JSON}), max_size=3),
    },
)
BODIES = st.one_of(
    JOB_LIKE.map(lambda b: json.dumps(b).encode()),
    JSON.map(lambda b: json.dumps(b).encode()),
    st.binary(max_size=64),
    st.just(b""),
)
ROUTES = ["/v1/jobs", "/v1/jobs/{id}", "/v1/jobs/{id}/events", "/healthz", "/readyz", "/metrics", "/{id}"]
HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=40)
HEADERS = st.dictionaries(
    st.sampled_from(["Idempotency-Key", "Content-Type", "traceparent", "tracestate", "Accept", "X-Anything"]),
    HEADER_TEXT | st.sampled_from(["application/json", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"]),
    max_size=3,
)
QUERIES = st.dictionaries(st.sampled_from(["wait", "x"]), st.sampled_from(["0", "0.01", "-1", "nan", "inf", "1e309"])
                          | HEADER_TEXT, max_size=2)


def request(conn: http.client.HTTPConnection, method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    conn.request(method, path, body=body if method in ("POST", "PUT", "PATCH", "DELETE") else None, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    if resp.getheader("Connection", "").lower() == "close":
        conn.close()
    return resp.status, data


def assert_answer(status: int, data: bytes, method: str, what: object) -> None:
    assert status < 500, (what, data[:300])
    if status >= 400 and method != "HEAD":
        reply: Any = json.loads(data)
        assert isinstance(reply["error"]["type"], str) and reply["error"]["message"], reply


def test_no_request_gets_a_5xx_and_every_error_is_json(redis_url: str, tmp_path: Path) -> None:
    with gateway_process(redis_url, tmp_path / "gateway.log", "--max-wait-s", "0.05",
                         "--sse-heartbeat-s", "0.05", "--max-body-bytes", "4096") as gateway:
        port = int(gateway.url.rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        seen: list[int] = []

        @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=JOB_LIKE, headers=HEADERS)
        def submit(body: dict[str, Any], headers: dict[str, str]) -> None:
            status, data = request(conn, "POST", "/v1/jobs", json.dumps(body).encode(), headers)
            seen.append(status)
            assert_answer(status, data, "POST", (body, headers))

        @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
        @given(method=st.sampled_from(["GET", "POST", "DELETE", "PUT", "PATCH", "HEAD"]), route=st.sampled_from(ROUTES),
               job_id=ANY_TEXT | st.sampled_from(["job_1", "x" * 300]), query=QUERIES, headers=HEADERS, body=BODIES)
        def anything(method: str, route: str, job_id: str, query: dict[str, str], headers: dict[str, str], body: bytes) -> None:
            path = route.replace("{id}", urllib.parse.quote(job_id.encode("utf-8", "surrogatepass"), safe=""))
            if query:
                path += "?" + urllib.parse.urlencode(query, encoding="utf-8", errors="surrogatepass")
            status, data = request(conn, method, path, body, headers)
            seen.append(status)
            assert_answer(status, data, method, (method, path, headers, body))

        submit()
        anything()
        conn.close()
    assert set(seen) >= {200, 202, 400, 404, 405}
    assert "Traceback" not in gateway.log_text()


HUGE = st.sampled_from([10**400, -(10**400), 2**64, 1e308]) | st.integers(min_value=-(10**30), max_value=10**30)
OPENAI_JSON = st.recursive(SCALARS | HUGE, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(ANY_TEXT | st.sampled_from(["role", "content", "url", "type", "k"]),
                                             inner, max_size=3), max_leaves=8)
MESSAGES = st.just([{"role": "user", "content": "hi"}]) | st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]) | OPENAI_JSON,
                           "content": st.just("hi") | OPENAI_JSON}), min_size=1, max_size=2) | OPENAI_JSON


def openai_bodies(endpoint: Endpoint, base: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """A request that is valid but for one or two fields of any JSON (more would rarely pass the first check)."""
    fields = sorted(KNOWN[endpoint])
    return st.builds(lambda good, odd: {**good, **odd}, st.fixed_dictionaries(base),
                     st.dictionaries(st.sampled_from(fields), HUGE | OPENAI_JSON, max_size=2))


OPENAI_REQUESTS = (openai_bodies(Endpoint.CHAT, {"model": st.just("carpool-tiny"), "messages": MESSAGES})
                   .map(lambda body: ("/v1/chat/completions", body))
                   | openai_bodies(Endpoint.COMPLETIONS, {"model": st.just("carpool-tiny"), "prompt": st.just("hi")})
                   .map(lambda body: ("/v1/completions", body)))
BATCH_BODIES = st.fixed_dictionaries({}, optional={
    name: OPENAI_JSON | st.sampled_from(["24h", "/v1/chat/completions", "file-x", {"url": "https://a.example/h"}])
    for name in ("input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after", "webhook")})
OPENAI_ROUTES = ["/v1/files/{id}", "/v1/files/{id}/content", "/v1/batches/{id}", "/v1/batches/{id}/cancel",
                 "/v1/models/{id}", "/v1/files", "/v1/batches", "/v1/models"]


def test_no_openai_request_gets_a_5xx_and_every_error_is_openais_shape(redis_url: str, tmp_path: Path) -> None:
    """The OpenAI routes' bodies hold any JSON in any known field (wrong types, integers past float's range, lone
    surrogates), and their ids any text: each is refused with a 4xx in OpenAI's error shape, or served."""
    # Every lane full, so that a request valid to the end is refused (429) rather than left waiting for a worker.
    with gateway_process(redis_url, tmp_path / "gateway.log", "--max-body-bytes", "8192",
                         "--max-lane-depth", "interactive=1,standard=1,batch=1") as gateway:
        port = int(gateway.url.rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for lane in ("interactive", "standard", "batch"):
            assert request(conn, "POST", "/v1/jobs", json.dumps({"prompt": "x", "lane": lane}).encode(), {})[0] == 202
        seen: list[int] = []

        def check(method: str, path: str, body: bytes, what: object) -> None:
            status, data = request(conn, method, path, body, {"Content-Type": "application/json"})
            seen.append(status)
            assert status < 500, (what, data[:300])
            if status >= 400:
                error = json.loads(data)["error"]
                assert isinstance(error["type"], str) and error["message"] and "code" in error, error

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
        @given(route_and_body=OPENAI_REQUESTS)
        def complete(route_and_body: tuple[str, dict[str, Any]]) -> None:
            route, body = route_and_body
            check("POST", route, json.dumps(body).encode(), (route, body))

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=BATCH_BODIES)
        def create_batch(body: dict[str, Any]) -> None:
            check("POST", "/v1/batches", json.dumps(body).encode(), body)

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(method=st.sampled_from(["GET", "POST", "DELETE"]), route=st.sampled_from(OPENAI_ROUTES),
               item_id=ANY_TEXT | st.sampled_from(["file-x", "batch_x", "x" * 300]), query=QUERIES)
        def by_id(method: str, route: str, item_id: str, query: dict[str, str]) -> None:
            path = route.replace("{id}", urllib.parse.quote(item_id.encode("utf-8", "surrogatepass"), safe=""))
            if query:
                path += "?" + urllib.parse.urlencode(query, encoding="utf-8", errors="surrogatepass")
            check(method, path, b"", (method, path))

        complete()
        create_batch()
        by_id()
        conn.close()
    assert set(seen) >= {400, 404, 429}
    assert "Traceback" not in gateway.log_text()
