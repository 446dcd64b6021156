"""`carpool up` takes the worker's and the gateway's flags and its log level, its help says each default once,
and the gateway admits against the context length the workers report."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from gateway.cli.embedded_redis import free_port
from tests.harness.fixed_answer import answering
from tests.harness.up_stack import UpStack, carpool, carpool_env, start_up

CONTEXT = 64
MAX_BODY = 4096
RESULT_TTL_S = 500


@pytest.fixture(scope="module")
def stack(tiny_model: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpStack]:
    up = start_up(tmp_path_factory.mktemp("up"), "--model", tiny_model("llama"), "--max-num-seqs", "3",
                  "--max-model-len", str(CONTEXT), "--log-level", "warning", "--served-model-name", "tiny-up",
                  "--max-body-bytes", str(MAX_BODY), "--result-ttl-s", str(RESULT_TTL_S))
    yield up
    assert up.stop() == 0, up.log()


def _post(base: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"{base}/v1/jobs", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait_final(base: str, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while True:
        with urllib.request.urlopen(f"{base}/v1/jobs/{job_id}?wait=10", timeout=40) as resp:
            view = json.loads(resp.read())
        if view["status"] not in ("queued", "running") or time.monotonic() > deadline:
            return view


@pytest.mark.slow
def test_up_passes_engine_flags_and_log_level_to_its_worker(stack: UpStack) -> None:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        ((name, raw),) = client.hgetall("carpool:workers").items()
        beat = msgpack.unpackb(raw)
    finally:
        client.close()
    assert beat["capacity"] == 3 and beat["max_model_len"] == CONTEXT
    # A name it was not given is the worker's own, its pid in it (not up's).
    (worker_pid,) = re.findall(r"carpool: worker +pid (\d+)", stack.log())
    assert f"-{worker_pid}-" in name.decode() and f"-{stack.proc.pid}-" not in name.decode(), (name, worker_pid)
    worker_lines = [json.loads(line) for line in stack.log().splitlines()
                    if line.startswith("{") and '"carpool-worker"' in line]
    assert not [line for line in worker_lines if line.get("level") in ("DEBUG", "INFO")], worker_lines


@pytest.mark.slow
def test_up_hands_the_gateway_its_flags_and_a_shared_one_to_both(stack: UpStack) -> None:
    with urllib.request.urlopen(f"{stack.base}/v1/models", timeout=30) as resp:
        models = [m["id"] for m in json.loads(resp.read())["data"]]
    assert models == ["tiny-up"], models  # the worker's --served-model-name
    status, body = _post(stack.base, {"prompt": "x" * MAX_BODY})
    assert status == 413, body  # the gateway's --max-body-bytes
    status, body = _post(stack.base, {"id": "ttl", "prompt": "hi", "params": {"max_tokens": 2}})
    assert status == 202 and _wait_final(stack.base, "ttl")["status"] == "succeeded", body
    client = redis.Redis.from_url(stack.redis_url)
    try:
        ttl = client.ttl("carpool:job:ttl")
    finally:
        client.close()
    assert 0 < ttl <= RESULT_TTL_S, ttl  # --result-ttl-s, which the worker applies to the job it ends


@pytest.mark.slow
def test_the_gateway_admits_against_the_workers_context(stack: UpStack) -> None:
    status, body = _post(stack.base, {"prompt_token_ids": [5] * (CONTEXT + 6), "params": {"max_tokens": 4}})
    assert status == 400 and body["error"]["field"] == "prompt_token_ids", body
    status, body = _post(stack.base, {"prompt_token_ids": [5] * (CONTEXT - 4), "params": {"max_tokens": 10}})
    assert status == 400 and body["error"]["field"] == "params.max_tokens", body
    status, body = _post(stack.base, {"prompt_token_ids": [5] * (CONTEXT - 10), "params": {"max_tokens": 10}})
    assert status == 202, body


@pytest.mark.slow
def test_an_over_long_text_prompt_fails_naming_the_prompt_with_its_length(stack: UpStack) -> None:
    status, body = _post(stack.base, {"id": "long-text", "prompt": "x" * (CONTEXT * 3), "params": {"max_tokens": 4}})
    assert status == 202, body
    view = _wait_final(stack.base, "long-text")
    assert view["status"] == "failed"
    assert view["error"]["message"].startswith("prompt: "), view["error"]
    assert view["usage"]["prompt_tokens"] >= CONTEXT * 3


def test_up_takes_every_setting_of_the_worker_and_the_gateway_but_those_it_sets_itself() -> None:
    from gateway.cli.up import GATEWAY_SET_BY_UP, WORKER_SET_BY_UP
    from gateway.config import GatewayConfig
    from scheduler.runtime.flags import flag_fields
    from worker.config import WorkerConfig
    from worker.engine.config import EngineConfig

    # Up's own flags set these: its Redis URL and key prefix, its gateway's address, its worker's metrics server
    # (--worker-metrics-port) and grace period (--worker-grace-s), one --log-level; the gateway's own grace is kept.
    assert WORKER_SET_BY_UP == {"redis_url", "key_prefix", "metrics_host", "metrics_port", "shutdown_grace_s",
                                "log_level"}
    assert GATEWAY_SET_BY_UP == {"redis_url", "host", "port", "key_prefix", "api_keys", "shutdown_grace_s"}
    up_help = carpool("up", "--help").stdout
    worker_flags = flag_fields(WorkerConfig, WORKER_SET_BY_UP)
    gateway_flags = flag_fields(GatewayConfig, GATEWAY_SET_BY_UP)
    taken = set(worker_flags) | set(gateway_flags)
    assert set(flag_fields(EngineConfig)) <= taken and {"served_model_name", "lease_s", "max_lane_depth"} <= taken
    # A setting both have is one flag, its default the worker's: the two defaults must be the same.
    worker_defaults, gateway_defaults = WorkerConfig(), GatewayConfig()
    for name in set(worker_flags) & set(gateway_flags):
        worker_value = getattr(worker_defaults, name, getattr(worker_defaults.engine, name, None))
        assert worker_value == getattr(gateway_defaults, name), name
    for name in taken:
        assert re.search(rf"^  --{name.replace('_', '-')}\b", up_help, re.MULTILINE), name


def test_help_says_each_default_once() -> None:
    for verb in ("up", "gateway", "worker"):
        text = carpool(verb, "--help").stdout
        for flag_help in re.split(r"\n  -", text):
            assert flag_help.count("(default:") <= 1 and "(default: None)" not in flag_help, (verb, flag_help)
            assert not ("default:" in flag_help.replace("(default:", "") and "(default:" in flag_help), (verb, flag_help)


@pytest.mark.slow
def test_up_gives_its_gateway_and_worker_one_key_prefix_from_the_environment(
        redis_url: str, tiny_model: Callable[..., str], tmp_path: Path) -> None:
    """CARPOOL_KEY_PREFIX, like every up flag's variable, is read by up and handed to its worker: a job the gateway
    queues under the prefix is the one the worker runs."""
    up = start_up(tmp_path, "--redis-url", redis_url, "--model", tiny_model("llama"),
                  env=carpool_env(CARPOOL_KEY_PREFIX="foo"))
    try:
        status, body = _post(up.base, {"id": "prefixed", "prompt": "hi", "params": {"max_tokens": 2}})
        assert status == 202, body
        view = _wait_final(up.base, "prefixed")
        client = redis.Redis.from_url(redis_url)
        try:
            names = client.keys("*")
        finally:
            client.close()
    finally:
        assert up.stop() == 0, up.log()
    assert view["status"] == "succeeded", view
    assert names and all(name.startswith(b"foo:") for name in names), names


def test_a_worker_metrics_port_that_is_the_gateways_is_a_usage_error(tmp_path: Path) -> None:
    port = str(free_port())
    done = carpool("up", "--port", port, "--worker-metrics-port", port, "--redis-port", "0",
                   "--data-dir", str(tmp_path / "data"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--worker-metrics-port: must differ from the gateway's port" in done.stderr
    assert not (tmp_path / "data").exists()  # no Redis was started


def test_a_worker_metrics_port_another_server_holds_is_refused_before_ready(tmp_path: Path) -> None:
    """Another server there answers /readyz 200: up must not take that for its worker being ready."""
    with answering(200, b'{"ready": true, "running": 0}') as url:
        port = url.rsplit(":", 1)[1]
        done = carpool("up", "--port", str(free_port()), "--worker-metrics-port", port, "--redis-port", "0",
                       "--data-dir", str(tmp_path / "data"), timeout_s=60)
    assert done.returncode == 1 and "carpool: ready" not in done.stdout, done.stdout + done.stderr
    assert f"port {port} (--worker-metrics-port) is in use" in done.stderr, done.stderr
