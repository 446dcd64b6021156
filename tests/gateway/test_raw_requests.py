"""Requests no HTTP client library sends, written byte by byte to a real gateway: bytes that are no UTF-8 in
headers, a charset that names no text encoding, multipart bodies without or past their boundary. Each gets a
4xx naming what is wrong, never a 5xx, and the gateway goes on serving."""

from __future__ import annotations

import asyncio
import gzip
import json
import re

import pytest

from gateway.app import init_app
from gateway.config import GatewayConfig
from tests.harness.gateway_server import GatewayTestServer

JOB = b'{"prompt": "hi"}'
FORM = b"Content-Type: multipart/form-data; boundary=abc"


def _part(headers: bytes, content: bytes = b"batch") -> bytes:
    return b"--abc\r\n" + headers + b"\r\n\r\n" + content + b"\r\n--abc--\r\n"


# (method, path, extra header lines, body, the status, what the error names)
CASES = [
    ("POST", "/v1/jobs", b"Content-Type: application/json; charset=\xff", JOB, 400, "charset"),
    ("POST", "/v1/jobs", b"Content-Type: application/json; charset=rot13", JOB, 400, "charset"),
    ("POST", "/v1/chat/completions", b"Content-Type: application/json; charset=hex", b"{}", 400, "charset"),
    ("POST", "/v1/jobs", b"Idempotency-Key: k\xff", JOB, 400, "Idempotency-Key"),
    ("POST", "/v1/files", b"Content-Type: multipart/form-data", b"--x\r\n", 400, "boundary"),
    ("POST", "/v1/files", b"Content-Type: multipart/form-data; boundary=\xff", b"--\xff\r\n", 400, "ASCII"),
    ("POST", "/v1/files", FORM, b"garbage", 400, "starting boundary"),
    ("POST", "/v1/files", FORM, b'--abc\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch', 400, "EOF"),
    ("POST", "/v1/files", FORM, _part(b'Content-Type: multipart/mixed; boundary=\xff\r\n'
                                      b'Content-Disposition: form-data; name="file"'), 400, "ASCII"),
    ("POST", "/v1/files", FORM, _part(b'Content-Disposition: form-data; name="purpose"\r\n'
                                      b"Content-Transfer-Encoding: whatever"), 400, "transfer encoding"),
    ("POST", "/v1/files", FORM, _part(b'Content-Disposition: form-data; name="purpose"\r\n'
                                      b"Content-Transfer-Encoding: base64", b"!!!"), 400, "purpose"),
    ("POST", "/v1/files", FORM, _part(b'Content-Disposition: form-data; name="file"; filename="\xff.jsonl"',
                                      b"{}"), 400, "purpose"),
    # A file that is no UTF-8 is named with the line where it stops being so.
    ("POST", "/v1/files", FORM, b'--abc\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
     + _part(b'Content-Disposition: form-data; name="file"; filename="b.jsonl"', b'{"a": 1}\r\n{"b": "\xff"}\n'),
     400, "must be UTF-8 JSONL: line 2: "),
    # A body that is not what its Content-Encoding says.
    ("POST", "/v1/jobs", b"Content-Type: application/json\r\nContent-Encoding: gzip", b"garbage", 400, "body"),
    ("POST", "/v1/chat/completions", b"Content-Type: application/json\r\nContent-Encoding: deflate",
     gzip.compress(b"{}", mtime=0), 400, "cannot be read"),
    ("POST", "/v1/files", FORM + b"\r\nContent-Encoding: gzip", b"garbage", 400, "cannot be read"),
]


async def _send(port: int, method: str, path: str, headers: bytes, body: bytes) -> tuple[int, dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
                 .encode() + headers + b"\r\n\r\n" + body)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, content = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(content)


@pytest.fixture
async def gateway_port(redis_url: str):
    server = GatewayTestServer(init_app(GatewayConfig(redis_url=redis_url, no_webhooks=True)), host="127.0.0.1")
    await server.start_server()
    yield server.port
    await server.close()


@pytest.mark.parametrize(("method", "path", "headers", "body", "status", "named"), CASES)
async def test_a_request_no_client_sends_gets_a_4xx_naming_the_fault(gateway_port, method, path, headers, body,
                                                                      status, named) -> None:
    got, answer = await _send(gateway_port, method, path, headers, body)
    assert got == status, answer
    assert named in json.dumps(answer), answer
    # The gateway goes on serving.
    got, answer = await _send(gateway_port, "POST", "/v1/jobs", b"Content-Type: application/json", JOB)
    assert got == 202, answer


async def test_a_client_that_hangs_up_mid_body_is_counted_as_gone_not_as_a_server_fault(gateway_port) -> None:
    for path in ("/v1/jobs", "/v1/chat/completions"):
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway_port)
        writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100"
                     "\r\n\r\n{\"prompt\"".encode())
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.close()
        await writer.wait_closed()
    await asyncio.sleep(0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway_port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    exposition = (await reader.read()).decode()
    writer.close()
    statuses = set(re.findall(r'http_response_status_code="(\d+)"', exposition))
    assert "499" in statuses and not any(s.startswith("5") for s in statuses), statuses


@pytest.fixture
async def impatient_gateway_port(redis_url: str):
    """A gateway that waits 1 s for the next byte of a request's body."""
    config = GatewayConfig(redis_url=redis_url, no_webhooks=True, body_timeout_s=1.0)
    server = GatewayTestServer(init_app(config), host="127.0.0.1")
    await server.start_server()
    yield server.port
    await server.close()


@pytest.mark.parametrize(("path", "headers", "start"), [
    ("/v1/jobs", b"Content-Type: application/json", b'{"prompt"'),
    ("/v1/chat/completions", b"Content-Type: application/json", b'{"model"'),
    ("/v1/files", FORM, b'--abc\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{"cus'),
])
async def test_a_body_that_stops_arriving_is_answered_408_and_its_connection_closed(impatient_gateway_port, path,
                                                                                     headers, start) -> None:
    """A client that announces a body and stops sending it (a stalled or hostile one) holds no connection or
    handler beyond --body-timeout-s: it gets a 408 naming the body, in its route's error shape, and the
    connection is closed; the gateway goes on serving."""
    reader, writer = await asyncio.open_connection("127.0.0.1", impatient_gateway_port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n".encode() + headers + b"\r\n\r\n"
                 + start)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 30)  # read to the end: the server closes the connection
    writer.close()
    head, _, content = answer.partition(b"\r\n\r\n")
    assert head.split()[1] == b"408", answer
    error = json.loads(content)["error"]
    assert "the request body stopped arriving: no byte of it for 1 s" in error["message"], error
    assert error.get("param", error.get("field")) == "body", error
    got, answer = await _send(impatient_gateway_port, "POST", "/v1/jobs", b"Content-Type: application/json", JOB)
    assert got == 202, answer


async def test_a_slow_body_that_keeps_coming_is_waited_for(redis_url: str) -> None:
    """The timeout is between bytes, not for the whole body: one that trickles in over longer than it is taken."""
    config = GatewayConfig(redis_url=redis_url, no_webhooks=True, body_timeout_s=2.0)
    server = GatewayTestServer(init_app(config), host="127.0.0.1")
    await server.start_server()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(JOB)}\r\nConnection: close\r\n\r\n".encode())
        for i in range(0, len(JOB), 3):  # 3.6 s in all, 0.6 s between pieces
            await asyncio.sleep(0.6)
            writer.write(JOB[i:i + 3])
            await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 30)
        writer.close()
    finally:
        await server.close()
    assert answer.split()[1] == b"202", answer


@pytest.mark.parametrize(("path", "named"), [("/v1/jobs", "limit of"), ("/v1/chat/completions", "limit of"),
                                             ("/v1/files", "file_too_large")])
async def test_a_body_announced_past_the_limit_is_refused_before_it_is_sent(gateway_port, path, named) -> None:
    """Nothing of it is read: the answer comes while the client has sent only its headers."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway_port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Content-Length: 99999999999\r\n\r\n".encode())
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(re.search(rb"Content-Length: (\d+)", head, re.IGNORECASE).group(1))
    body = await asyncio.wait_for(reader.readexactly(length), 10)
    writer.close()
    assert head.split()[1] == b"413" and named.encode() in body, (head, body)


def test_connections_that_send_nothing_more_are_closed_after_the_keepalive_timeout(redis_url: str, tmp_path) -> None:
    """An idle connection, one that sent half its headers, and one whose request was answered: each is closed once
    it has been idle for --keepalive-timeout-s, so clients that hold sockets open hold them only that long."""
    import socket

    from tests.harness.gateway_process import gateway_process

    with gateway_process(redis_url, tmp_path / "gateway.log", "--keepalive-timeout-s", "1") as gateway:
        host, port = gateway.url.removeprefix("http://").split(":")
        idle = socket.create_connection((host, int(port)))
        partial = socket.create_connection((host, int(port)))
        partial.sendall(b"GET /healthz HTTP/1.1\r\n")
        answered = socket.create_connection((host, int(port)))
        answered.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answered.recv(100).startswith(b"HTTP/1.1 200")
        for sock in (idle, partial, answered):
            sock.settimeout(30)  # far past the timeout: the server closes it first
            while sock.recv(65536):
                pass  # what the server says before closing (a 400 for the half request, say)
            sock.close()


def test_requests_aiohttps_parser_refuses_are_logged_as_client_errors_not_server_errors(redis_url: str,
                                                                                         tmp_path) -> None:
    """A header line past 8,190 bytes, a body in an encoding aiohttp cannot decode: a 400 each, and one info line in
    the log, not an error with a traceback that any client could repeat to fill the log."""
    import socket
    import time

    from tests.harness.gateway_process import gateway_process

    log_path = tmp_path / "gateway.log"
    with gateway_process(redis_url, log_path) as gateway:
        host, port = gateway.url.removeprefix("http://").split(":")
        for request in (b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Encoding: br\r\nContent-Length: 1\r\n\r\nx",
                        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n"):
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(request)
                assert sock.recv(100).split()[1] == b"400"
        deadline = time.monotonic() + 10
        while log_path.read_text().count("refused by the HTTP parser") < 2:
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    parser = [r for r in records if r["logger"] == "aiohttp.server"]
    assert len(parser) == 2 and all(r["level"] == "info" and "exc" not in r for r in parser), parser
    assert all(len(r["message"]) < 400 for r in parser), parser  # the long header is not copied whole


async def test_a_body_the_gateway_is_slow_to_read_is_not_taken_for_a_stalled_client() -> None:
    """A large body sent at once fills the server's buffer, and aiohttp stops reading the socket until the handler
    reads: a handler busy for longer than the timeout before it reads (a key looked up in a slow Redis) gets the
    whole body, not a 408."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from gateway.errors import error_middleware

    async def slow_then_read(request: web.Request) -> web.Response:
        await asyncio.sleep(1.5)
        return web.json_response({"read": len(await request.read())})

    app = web.Application(client_max_size=16 * 1024 * 1024,
                          middlewares=[error_middleware(2, 16 * 1024 * 1024, body_timeout_s=0.4)])
    app.router.add_post("/slow", slow_then_read)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    body = b"x" * (8 * 1024 * 1024)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(f"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                     .encode() + body)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 30)
        writer.close()
    finally:
        await server.close()
    head, _, content = answer.partition(b"\r\n\r\n")
    assert head.split()[1] == b"200" and json.loads(content) == {"read": len(body)}, answer[:300]


async def _submit_and_cancel(port: int) -> str:
    got, answer = await _send(port, "POST", "/v1/jobs", b"Content-Type: application/json", JOB)
    assert got == 202, answer
    got, cancelled = await _send(port, "DELETE", f"/v1/jobs/{answer['id']}", b"", b"")
    assert got == 202 and cancelled["status"] == "cancelled", cancelled
    return answer["id"]


async def test_an_http10_event_stream_asked_to_keep_alive_ends_with_its_connection(gateway_port) -> None:
    """HTTP/1.0 has no chunked encoding: a streamed answer without a length ends only by closing, so a client
    that asked to keep the connection alive would otherwise wait for the end until the keep-alive timeout."""
    job_id = await _submit_and_cancel(gateway_port)
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway_port)
    writer.write(f"GET /v1/jobs/{job_id}/events HTTP/1.0\r\nConnection: keep-alive\r\n\r\n".encode())
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)  # to its end: the connection closed
    writer.close()
    assert answer.startswith(b"HTTP/1.0 200") and b"event: final" in answer, answer


async def test_a_client_that_hangs_up_while_it_waits_is_counted_as_gone(gateway_port) -> None:
    """A long-poll, and an event stream whose answer has begun (its 200 sent), whose client hangs up before the
    job ends: logged and counted 499, not as answered."""
    got, answer = await _send(gateway_port, "POST", "/v1/jobs", b"Content-Type: application/json", JOB)
    assert got == 202, answer
    for path in (f"/v1/jobs/{answer['id']}?wait=30", f"/v1/jobs/{answer['id']}/events"):
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway_port)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.close()
        await writer.wait_closed()
    await asyncio.sleep(2.0)  # each handler looks for its client every second
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway_port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    exposition = (await reader.read()).decode()
    writer.close()
    statuses = {(re.search(r'http_route="([^"]+)"', line)[1], re.search(r'http_response_status_code="(\d+)"', line)[1])
                for line in exposition.splitlines() if "http_response_status_code=" in line and "http_route=" in line}
    assert {("/v1/jobs/{id}", "499"), ("/v1/jobs/{id}/events", "499")} <= statuses, statuses
    assert ("/v1/jobs/{id}/events", "200") not in statuses, statuses
