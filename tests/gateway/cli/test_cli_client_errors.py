"""`carpool submit` and `carpool batch` against gateways that misbehave, ids that need quoting, and Ctrl-C:
one line on stderr and a documented exit status each, never a traceback; a job or batch already made is named."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from gateway.app import init_app
from gateway.cli.main import main
from gateway.config import GatewayConfig
from scheduler.protocol.keys import Keys
from tests.harness.child_env import child_pythonpath
from tests.harness.fixed_answer import answering
from tests.harness.gateway_server import GatewayTestServer
from tests.harness.worker_harness import wait_until

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def html_server() -> Iterator[str]:
    """A web server that answers every request 200 with an HTML page, as a proxy or a wrong port may."""
    with answering(200, b"<html><body>Welcome to nginx!</body></html>", "text/html") as url:
        yield url

async def test_submit_wait_reads_back_the_job_it_made_whatever_its_id(gateway_url: str, capsys) -> None:
    """Ids are any printable characters: each is one path segment when read back (`%42` is not `B`, `a?b` is no
    query), so the record printed is the job's own."""
    assert await asyncio.to_thread(main, ["submit", "first", "--id", "B", "--gateway", gateway_url], {}) == 0
    capsys.readouterr()
    for job_id in ("%42", "a?b", "z#1", "x/y", "é1"):
        argv = ["submit", "x", "--id", job_id, "--json", "--wait", "--timeout-s", "0", "--gateway", gateway_url]
        assert await asyncio.to_thread(main, argv, {}) == 3  # no worker: still queued
        captured = capsys.readouterr()
        assert json.loads(captured.out)["id"] == job_id, captured
        assert f"job {job_id} still queued" in captured.err and "Traceback" not in captured.err


@pytest.mark.parametrize("argv", [
    ["submit", "x"], ["submit", "x", "--wait"], ["batch", "status", "batch_1"], ["batch", "cancel", "batch_1"],
])
def test_an_answer_that_is_not_a_gateways_is_one_line(html_server: str, argv: list[str], capsys) -> None:
    assert main([*argv, "--gateway", html_server], {}) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"the answer from {html_server}/v1/" in err and "does --gateway name a carpool gateway?" in err, err


@pytest.fixture(params=[b"{}", b"<html><body>404 Not Found</body></html>"], ids=["json", "html"])
def not_found_server(request: pytest.FixtureRequest) -> Iterator[str]:
    """A web server that answers every request 404 with a body that is no carpool gateway's error."""
    with answering(404, request.param, None) as url:
        yield url

@pytest.mark.parametrize("argv", [["submit", "x"], ["batch", "status", "batch_1"], ["batch", "cancel", "batch_1"]])
def test_an_error_answer_that_is_not_a_gateways_is_no_refusal(not_found_server: str, argv: list[str], capsys) -> None:
    assert main([*argv, "--gateway", not_found_server], {}) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refused" not in err and "Traceback" not in err, err
    assert f"the answer from {not_found_server}/v1/" in err and "does --gateway name a carpool gateway?" in err, err


@pytest.fixture
def batch_server() -> Iterator[str]:
    """A web server that answers every GET with a batch longer than a pipe holds."""
    batch = {"id": "batch_1", "status": "completed", "metadata": {"x": "y" * 200_000}}
    with answering(200, json.dumps(batch).encode()) as url:
        yield url

def test_a_reader_that_stops_reading_ends_batch_status_quietly(batch_server: str) -> None:
    """`carpool batch status ID | head -2`: the gateway answered; the reader of standard output went away."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "gateway.cli", "batch", "status", "batch_1", "--gateway",
                               batch_server], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": child_pythonpath(REPO)})
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")


@pytest.mark.parametrize(("argv", "words"), [
    (["submit", "x", "--gateway", "not a url"], "unknown url type"),
    (["batch", "status", "b", "--gateway", "not a url"], "unknown url type"),
    (["submit", "x", "--idempotency-key", "two\nlines", "--gateway", "http://127.0.0.1:9"], "header"),
])
def test_a_request_that_cannot_be_sent_is_one_line_and_exit_2(argv: list[str], words: str, capsys) -> None:
    assert main(argv, {}) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv", [["submit", "x", "--wait", "--timeout-s", "-1"],
                                  ["batch", "submit", "f.jsonl", "--timeout-s", "nan"]])
def test_a_negative_or_unknown_wait_is_a_usage_error(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv, {})
    assert done.value.code == 2 and "--timeout-s" in capsys.readouterr().err


async def test_ctrl_c_while_waiting_names_the_job_that_goes_on(gateway_url: str, redis_url: str) -> None:
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "submit", "x", "--id", "waits", "--wait",
                             "--gateway", gateway_url], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    client = aioredis.Redis.from_url(redis_url)
    try:
        await wait_until(lambda: client.exists(Keys().job("waits")), "the job made")
        await asyncio.sleep(0.5)  # into its long-poll
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.to_thread(proc.communicate, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        await client.aclose()
    assert proc.returncode == 130 and "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    assert line.startswith("carpool submit: interrupted; job waits goes on") and "/v1/jobs/waits" in line, line


def test_generate_refuses_a_prompt_that_is_not_utf8_before_loading_a_model(tiny_model, capsys) -> None:
    from worker.cli import main as worker_main

    model = tiny_model()
    capsys.readouterr()
    # What Python makes of argv bytes the locale cannot decode: lone surrogates.
    assert worker_main(["generate", "caf\udce9 \udcff", "--model", model], {}) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not valid UTF-8" in err and "Traceback" not in err, err


def test_generate_dash_reads_the_prompt_from_standard_input(tiny_model, capsys, monkeypatch) -> None:
    """`carpool generate -` prints what `carpool generate TEXT` prints for the same text read from stdin; stdin
    that is not UTF-8 is refused in one line before the model loads."""
    from worker.cli import main as worker_main

    model = tiny_model()
    text = "two\nlines"
    assert worker_main(["generate", text, "--model", model, "--max-tokens", "6"], {}) == 0
    direct = capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    assert worker_main(["generate", "-", "--model", model, "--max-tokens", "6"], {}) == 0
    assert capsys.readouterr().out == direct and direct.strip()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff")))
    assert worker_main(["generate", "-", "--model", model], {}) == 2
    assert capsys.readouterr().err == "carpool generate: the prompt read from standard input is not valid UTF-8 text\n"
    # An empty prompt is refused as a job's is (`carpool submit ""`), not run on the model.
    assert worker_main(["generate", "", "--model", model], {}) == 2
    assert capsys.readouterr().err == "carpool generate: prompt: must be a non-empty string (- reads it from standard input)\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    assert worker_main(["generate", "-", "--model", model], {}) == 2
    assert capsys.readouterr().err == ("carpool generate: prompt: standard input held no text (a job's prompt must be a "
                                       "non-empty string)\n")


@pytest.mark.parametrize("data_dir", ["/dev/null/sub", "{file}"])
def test_up_with_a_data_dir_it_cannot_make_is_one_line(data_dir: str, tmp_path: Path, capsys) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert main(["up", "--data-dir", data_dir.format(file=a_file)], {}) == 1
    err = capsys.readouterr().err
    assert err.startswith("carpool up: cannot use ") and "as the data directory" in err and err.count("\n") == 1, err


async def test_a_submit_answered_with_an_existing_job_says_so(gateway_url: str, capsys) -> None:
    for text in ("first", "different text, same id"):
        assert await asyncio.to_thread(main, ["submit", text, "--id", "same", "--gateway", gateway_url], {}) == 0
    captured = capsys.readouterr()
    assert captured.out.split() == ["same", "same"]
    assert captured.err.count("\n") == 1 and "job same already existed" in captured.err, captured.err


@pytest.mark.parametrize("argv", [["keys", "list", "--data-dir", "{dir}"], ["redis-cli", "--data-dir", "{dir}", "PING"]])
def test_a_named_data_dir_without_carpool_up_redis_is_an_error_not_a_fall_back(argv: list[str], tmp_path: Path,
                                                                                capsys) -> None:
    missing = tmp_path / "never-used"
    assert main([part.format(dir=missing) for part in argv], {}) == 2
    err = capsys.readouterr().err
    assert f"no carpool up Redis in {missing}" in err and err.count("\n") == 1, err


def test_ctrl_c_while_the_command_imports_is_one_line_and_exit_130() -> None:
    """The console script's target, as pyproject.toml names it, run as pip's generated script runs it: a Ctrl-C
    before any verb runs (while aiohttp, redis and the parsers import) is one line too, never a traceback."""
    import tomllib

    target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["carpool"]
    module, function = target.split(":")
    script = f"import sys\nfrom {module} import {function}\nsys.exit({function}())\n"
    for delay_s in (0.15, 0.3):
        proc = subprocess.Popen([sys.executable, "-c", script, "keys", "list", "--redis-url", "redis://127.0.0.1:9/0"],
                                cwd=REPO, env={**os.environ, "PYTHONPATH": child_pythonpath(REPO)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(delay_s)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "Traceback" not in err, (delay_s, err)
        assert err.strip().splitlines() == ["carpool: interrupted"], (delay_s, err)


def test_the_built_in_model_note_never_fails_a_finished_job(not_found_server: str) -> None:
    """After a job ends, `submit --wait` asks /readyz whether the built-in model ran it, for a note only: a server
    there that is no gateway (a proxy routing /v1 alone, a 404 page) means no note, never a traceback."""
    from gateway.cli.submit import _is_builtin_model

    assert _is_builtin_model(not_found_server, "worker-1") is False


@pytest.mark.parametrize("answer", [b"[]", b'{"workers": []}', b'"ok"'])
def test_the_built_in_model_note_reads_any_json_readyz_answers(answer: bytes) -> None:
    from gateway.cli.submit import _is_builtin_model

    with answering(200, answer) as url:
        assert _is_builtin_model(url, "worker-1") is False


async def test_a_full_lane_says_when_to_submit_again(redis_url: str, capsys) -> None:
    """A 429 (and a 503) carries ``Retry-After``: `carpool submit` says it in its one line, so a script or a person
    knows how long to wait rather than trying again at once."""
    config = GatewayConfig(redis_url=redis_url, no_webhooks=True, max_lane_depth={"batch": 1}, retry_after_s=7)
    server = GatewayTestServer(init_app(config), host="127.0.0.1")
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        argv = ["submit", "x", "--lane", "batch", "--gateway", url]
        assert await asyncio.to_thread(main, argv, {}) == 0  # queued: no worker reads it
        capsys.readouterr()
        assert await asyncio.to_thread(main, argv, {}) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("carpool submit: refused: HTTP 429 (lane): lane batch is full"), err
        assert err.rstrip().endswith("lane batch is full (1 job, at most 1) (try again in 7 s)"), err
    finally:
        await server.close()
