"""The `carpool` command: flags and env fallbacks, `submit` against a live gateway, and `carpool up` end to end."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from gateway.app import init_app
from gateway.cli.embedded_redis import free_port, is_port_free
from gateway.cli.main import DELEGATED_VERBS, build_parser, main
from gateway.cli.up import UpConfig
from gateway.config import GatewayConfig
from scheduler.protocol.job import JobSpec
from scheduler.protocol.keys import Keys
from scheduler.runtime.flags import config_from_args, env_names
from scheduler.runtime.terminal import printable
from tests.harness.child_env import child_pythonpath
from tests.harness.gateway_server import GatewayTestServer

REPO = Path(__file__).resolve().parents[3]


def test_every_verb_is_listed() -> None:
    parser = build_parser({})
    (verbs,) = [a for a in parser._actions if a.dest == "verb"]
    assert set(verbs.choices) == {"up", "gateway", "submit", "batch", "keys", "bench", "redis-cli", *DELEGATED_VERBS}
    assert set(DELEGATED_VERBS) == {"worker", "generate", "webhooks"}


def test_gateway_flags_fall_back_to_env_and_flags_win() -> None:
    env = {"CARPOOL_REDIS_URL": "redis://10.0.0.5:6380/2", "CARPOOL_PORT": "9100",
           "CARPOOL_MAX_LANE_DEPTH": "batch=5", "CARPOOL_NO_WEBHOOKS": "true", "CARPOOL_WEBHOOK_ALLOW": "a.test,10.0.0.0/8"}
    args = build_parser(env).parse_args(["gateway", "--port", "9200", "--max-wait-s", "5"])
    config = config_from_args(GatewayConfig, args)
    assert config.redis_url == "redis://10.0.0.5:6380/2"
    assert config.port == 9200  # the flag beats the variable
    assert config.max_wait_s == 5.0
    assert config.max_lane_depth == {"interactive": 1_000, "standard": 10_000, "batch": 5}
    assert config.no_webhooks is True
    assert args.webhook_allow == ["a.test", "10.0.0.0/8"]
    names = env_names(GatewayConfig)
    assert names["--redis-url"] == "CARPOOL_REDIS_URL" and names["--max-model-len"] == "CARPOOL_MAX_MODEL_LEN"
    assert "--webhooks" not in names


def test_up_flags_and_defaults(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    args = build_parser({"CARPOOL_DEVICE": "cuda"}).parse_args(["up", "--model", str(tmp_path), "--port", "8100"])
    up = config_from_args(UpConfig, args)
    assert (up.redis_url, up.port) == (None, 8100)
    assert (args.model, args.device) == (str(tmp_path), "cuda")  # engine flags, handed to the worker


def test_bad_values_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser({"CARPOOL_PORT": "eighty"})
    assert exit_info.value.code == 2
    assert "CARPOOL_PORT='eighty'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["gateway", "--max-lane-depth", "express=3"], env={})
    assert "carpool gateway: error: --max-lane-depth: unknown lane 'express'" in capsys.readouterr().err
    # A Redis URL of another scheme: refused before anything starts, naming the flag (no traceback).
    assert main(["up", "--redis-url", "http://127.0.0.1:6379"], env={}) == 2
    err = capsys.readouterr().err
    assert err.startswith("carpool up: --redis-url: Redis URL must specify one of") and err.count("\n") == 1, err
    # NaN meets no bound, and a list flag's refusal names the kind of value.
    assert main(["up", "--worker-grace-s", "nan"], env={}) == 2
    assert "carpool up: --worker-grace-s: must be a finite number of seconds, not negative, got nan" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["webhooks", "--webhook-retry-schedule-s=-1,abc"], env={})
    assert "invalid comma-separated list value: '-1,abc'" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "unknown"), [(["submit", "hi", "--wiat"], "--wiat"),
                                                (["up", "--prot", "7400"], "--prot 7400"),
                                                (["generate", "x", "--foo"], "--foo"),
                                                (["worker", "--foo"], "--foo")])
def test_a_misspelt_flag_shows_its_verbs_usage(argv: list[str], unknown: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv, env={})
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(f"usage: carpool {argv[0]} "), err
    assert f"carpool {argv[0]}: error: unrecognized arguments: {unknown}" in err


def test_generate_and_submit_default_to_a_jobs_length_and_say_so() -> None:
    """The same prompt prints the same text from `generate` and `submit --wait`: both greedy, both a job's
    default length, and their help says what it is."""
    from scheduler.params import SamplingParams
    from worker.cli import build_parser as worker_parser

    generate = worker_parser({}).parse_args(["generate", "x"])
    submit = build_parser({}).parse_args(["submit", "x"])
    assert (generate.max_tokens, generate.temperature) == (SamplingParams().max_tokens, 0.0)
    assert (submit.max_tokens, submit.temperature) == (None, 0.0)  # None: the job's default
    for parser, verb in ((worker_parser({}), "generate"), (build_parser({}), "submit")):
        help_text = " ".join(next(action for action in parser._actions if action.dest == "verb")
                             .choices[verb].format_help().split())
        assert f"most tokens to generate (default {SamplingParams().max_tokens}" in help_text, help_text


def test_version_and_malformed_variables_of_the_other_verbs(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"], env={})
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"carpool {version('carpool')}\n"
    # Not a traceback: the verb's usage error naming the flag, as for any other verb.
    for argv, env, flag in ((["webhooks"], {"CARPOOL_METRICS_PORT": "abc"}, "--metrics-port"),
                            (["bench", "--quick"], {"CARPOOL_BENCH_SEED": "abc"}, "--seed")):
        with pytest.raises(SystemExit) as exit_info:
            os.environ.update(env)
            try:
                main(argv, env=env)
            finally:
                for name in env:
                    os.environ.pop(name)
        assert exit_info.value.code == 2
        assert f"error: argument {flag}: invalid int value: 'abc'" in capsys.readouterr().err


@pytest.fixture
async def gateway_url(redis_url: str) -> AsyncIterator[str]:
    server = GatewayTestServer(init_app(GatewayConfig(redis_url=redis_url, no_webhooks=True)), host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


async def test_submit_posts_a_job(gateway_url: str, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["submit", "tell me", "--lane", "interactive", "--max-tokens", "7", "--temperature", "0", "--gateway", gateway_url]
    assert await asyncio.to_thread(main, argv, {}) == 0
    job_id = capsys.readouterr().out.strip()
    client = aioredis.Redis.from_url(redis_url)
    try:
        record = await client.hgetall(Keys().job(job_id))
        assert record[b"status"] == b"queued" and record[b"lane"] == b"interactive"
        assert await client.xlen(Keys().lane("interactive")) == 1
    finally:
        await client.aclose()


async def test_submit_dash_reads_the_prompt_from_standard_input(
        gateway_url: str, redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`carpool submit - < prompt.txt`: the whole of stdin, newlines and all, is the prompt; stdin that is not
    UTF-8 is a usage error in one line, and nothing is submitted."""
    text = "line one\nline two: caf\u00e9 \U0001f44b\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    assert await asyncio.to_thread(main, ["submit", "-", "--gateway", gateway_url], {}) == 0
    job_id = capsys.readouterr().out.strip()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9\n")))
    assert await asyncio.to_thread(main, ["submit", "-", "--gateway", gateway_url], {}) == 2
    err = capsys.readouterr().err
    assert err == "carpool submit: the prompt read from standard input is not valid UTF-8 text\n", err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    assert await asyncio.to_thread(main, ["submit", "-", "--gateway", gateway_url], {}) == 2
    err = capsys.readouterr().err
    assert err == "carpool submit: prompt: standard input held no text (a job's prompt must be a non-empty string)\n", err
    client = aioredis.Redis.from_url(redis_url)
    try:
        (entry,) = await client.xrange(Keys().lane("standard"))
        assert JobSpec.unpack(entry[1][b"job"]).prompt == text and JobSpec.unpack(entry[1][b"job"]).id == job_id
    finally:
        await client.aclose()


async def test_submit_reports_a_refusal(gateway_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["submit", "x", "--max-tokens", "0", "--gateway", gateway_url]
    assert await asyncio.to_thread(main, argv, {}) == 2
    assert "params.max_tokens" in capsys.readouterr().err


def test_submit_reports_an_unreachable_gateway(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["submit", "x", "--gateway", f"http://127.0.0.1:{free_port()}"], env={}) == 1
    assert "cannot reach the gateway" in capsys.readouterr().err


def test_keys_reports_an_unreachable_redis(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}"
    assert main(["keys", "create", "--tenant", "acme", "--redis-url", url], env={}) == 1
    err = capsys.readouterr().err
    assert f"cannot reach Redis at {url}" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_redis_cli_names_the_redis_it_cannot_reach_and_where_to_look(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """redis-cli's own "Could not connect" names an address only: whichever way the URL was found (a flag, the
    environment, a data directory's `carpool up`), `carpool redis-cli` says it in one line, as `carpool keys` does."""
    from gateway.cli.redis_cli import REDIS_URL_FILE

    url = f"redis://127.0.0.1:{free_port()}/0"
    (tmp_path / REDIS_URL_FILE).write_text(url)  # a `carpool up` that has stopped
    for argv, env in [(["redis-cli", "--redis-url", url, "PING"], {}), (["redis-cli", "PING"], {"CARPOOL_REDIS_URL": url}),
                      (["redis-cli", "--data-dir", str(tmp_path), "PING"], {})]:
        assert main(argv, env=env) == 1
        err = capsys.readouterr().err
        assert err == (f"carpool redis-cli: cannot reach Redis at {url} ([Errno 111] Connection refused); is `carpool "
                       "up` running, or is it another deployment's Redis (--redis-url)?\n"), err


def test_redis_cli_given_an_address_of_its_own_reaches_it(redis_url: str, capfd: pytest.CaptureFixture[str]) -> None:
    """redis-cli's own -h/-p beat the URL carpool finds: no Redis at that URL refuses the command."""
    port = redis_url.rsplit(":", 1)[1].split("/")[0]
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    assert main(["redis-cli", "--redis-url", nowhere, "-p", port, "PING"], env={}) == 0
    assert capfd.readouterr().out.strip() == "PONG"


def test_keys_reports_a_server_that_is_not_redis(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as listener:  # answers every connection with an HTTP error, as a web server would
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}"

        def answer() -> None:
            try:
                while True:
                    conn, _ = listener.accept()
                    with conn:
                        conn.recv(1024)
                        conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
            except OSError:  # the listener closed: the test is over
                return

        server = threading.Thread(target=answer, daemon=True)
        server.start()
        assert main(["keys", "list", "--redis-url", url], env={}) == 1
    err = capsys.readouterr().err
    assert f"carpool keys: Redis at {url} failed" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_output_to_a_reader_that_stopped_ends_quietly(redis_url: str) -> None:
    """`carpool keys list | head -1` style: the reader is gone before the listing is written."""
    assert main(["keys", "create", "--tenant", "acme", "--redis-url", redis_url], env={}) == 0
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "gateway.cli", "keys", "list", "--redis-url", redis_url],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": child_pythonpath(REPO)})
    finally:
        os.close(write_end)
    assert done.returncode == 141  # as a shell reports a process that SIGPIPE ended
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr


def test_a_port_held_only_by_closed_connections_is_free() -> None:
    """A Redis stopped a moment ago leaves its served connections in TIME_WAIT on its port: `carpool up` may
    start a new one there at once (redis-server binds with SO_REUSEADDR)."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as redis-server's listener
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert not is_port_free(port)  # a listening server holds it
        with socket.create_connection(("127.0.0.1", port)) as client:
            served, _ = listener.accept()
            served.close()  # the server's side closes first: its end of the connection waits in TIME_WAIT
            client.recv(1)
    assert is_port_free(port)


def _carpool(*args: str, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.slow
def test_up_then_submit_wait_prints_a_completion(tiny_model: Callable[..., str], tmp_path: Path) -> None:
    model = tiny_model("llama")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARPOOL_")}
    env["PYTHONPATH"] = child_pythonpath(REPO)
    log_path = tmp_path / "up.log"
    with open(log_path, "w") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "up", "--port", str(port), "--model", model,
             "--data-dir", str(tmp_path / "data"), "--redis-port", "0", "--worker-grace-s", "5", "--log-level", "info"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 180
        while "carpool: ready" not in log_path.read_text():
            assert up.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        done = _carpool("submit", "hello", "--wait", "--max-tokens", "6", "--temperature", "0",
                        "--id", "e2e-1", "--gateway", base, env=env, timeout_s=120)
        assert done.returncode == 0, done.stderr + log_path.read_text()
        with urllib.request.urlopen(f"{base}/v1/jobs/e2e-1") as resp:
            view = json.loads(resp.read())
        assert view["status"] == "succeeded"
        assert view["usage"]["completion_tokens"] == len(view["output"]["token_ids"]) > 0
        assert done.stdout == printable(view["output"]["text"]) + "\n"
        assert (tmp_path / "data" / "redis").is_dir()
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(timeout=60)
    out = log_path.read_text()
    assert code == 0, out
    assert out.index("carpool: shutting down") < out.index("carpool: worker stopped (0)") < out.index("carpool: redis stopped")
    assert "leaked" not in out  # no extension module's leak report on a clean stop
    # the gateway logs JSON lines like `carpool gateway` (the worker child's own say carpool-worker)
    services = {json.loads(line)["service"] for line in out.splitlines() if line.startswith("{")}
    assert {"carpool-gateway", "carpool-worker"} <= services, out


def test_keys_finds_the_redis_of_a_carpool_up_started_with_a_data_dir(redis_url: str, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`carpool up --data-dir D` writes its Redis URL into D; `carpool keys --data-dir D` reads it there, as
    `carpool redis-cli --data-dir D` does, and CARPOOL_DATA_DIR does the same."""
    from gateway.cli.redis_cli import REDIS_URL_FILE

    (tmp_path / REDIS_URL_FILE).write_text(redis_url)
    assert main(["keys", "create", "--tenant", "acme", "--data-dir", str(tmp_path), "--json"], env={}) == 0
    created = json.loads(capsys.readouterr().out)
    assert main(["keys", "list", "--json"], env={"CARPOOL_DATA_DIR": str(tmp_path)}) == 0
    assert [k["id"] for k in json.loads(capsys.readouterr().out)] == [created["id"]]
    # A flag beats the environment: --data-dir D with CARPOOL_REDIS_URL naming another Redis is D's Redis.
    elsewhere = {"CARPOOL_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    assert main(["keys", "list", "--json", "--data-dir", str(tmp_path)], env=elsewhere) == 0
    assert [k["id"] for k in json.loads(capsys.readouterr().out)] == [created["id"]]
    assert main(["keys", "list", "--json"], env=elsewhere) == 1  # without the flag, the variable is the Redis
    assert "cannot reach Redis" in capsys.readouterr().err
    assert main(["keys", "list", "--json", "--redis-url", redis_url],
                env={"CARPOOL_DATA_DIR": str(tmp_path / "nothing-here")}) == 0
    capsys.readouterr()


def test_keys_takes_its_connection_flags_before_or_after_the_action_and_revoke_prints_json(
        redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`carpool keys --data-dir D list`, as the README writes it, is `carpool keys list --data-dir D`; and
    `revoke --json` prints JSON like `create --json` and `list --json`."""
    from gateway.cli.redis_cli import REDIS_URL_FILE

    (tmp_path / REDIS_URL_FILE).write_text(redis_url)
    assert main(["keys", "--data-dir", str(tmp_path), "--json", "create", "--tenant", "acme"], env={}) == 0
    created = json.loads(capsys.readouterr().out)
    assert main(["keys", "--data-dir", str(tmp_path), "list", "--json"], env={}) == 0
    assert [k["id"] for k in json.loads(capsys.readouterr().out)] == [created["id"]]
    # given twice, the flag after the action wins
    assert main(["keys", "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "list", "--redis-url", redis_url],
                env={}) == 0
    capsys.readouterr()
    assert main(["keys", "revoke", created["id"], "--redis-url", redis_url, "--json"], env={}) == 0
    out = capsys.readouterr()
    assert json.loads(out.out) == {"id": created["id"], "revoked": True} and out.err == ""


def test_a_refused_setting_names_its_variable_only_where_the_value_came_from_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    """From the environment alone: the flag and its variable, as a deployment sets it; given as a flag too (which
    wins): the flag alone, whatever the environment holds."""
    assert main(["worker"], env={"CARPOOL_LEASE_S": "0"}) == 2
    assert capsys.readouterr().err.startswith("carpool worker: --lease-s (CARPOOL_LEASE_S): must be")
    for flag in (["--lease-s", "0"], ["--lease-s=0"]):
        assert main(["worker", *flag], env={"CARPOOL_LEASE_S": "5"}) == 2
        assert capsys.readouterr().err.startswith("carpool worker: --lease-s: must be")
