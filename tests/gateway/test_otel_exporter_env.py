"""The standard OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER variables as an operator sets them on a real
`carpool gateway`: `console` writes one JSON line per span on stdout (the gateway's spans of one job share
its trace), and a value carpool does not support is refused at start with one line, never ignored."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gateway.cli.embedded_redis import free_port
from gateway.webhooks.signing import generate_secret
from tests.harness.child_env import child_pythonpath

REPO = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CARPOOL_", "OTEL_"))}
    env["PYTHONPATH"] = child_pythonpath(REPO)
    env.update(extra)
    return env


def test_console_traces_print_the_jobs_spans(redis_url: str, tmp_path: Path) -> None:
    port = free_port()
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "gateway", "--port", str(port), "--redis-url", redis_url,
             "--no-webhooks"], cwd=REPO, env=_env(OTEL_TRACES_EXPORTER="console"), stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + 30
        while "Running on" not in err_path.read_text():
            assert gateway.poll() is None, err_path.read_text()
            assert time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.1)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/jobs", method="POST",
                                         data=json.dumps({"id": "console-1", "prompt": "hi"}).encode(),
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request) as response:
            assert response.status == 202
    finally:
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(timeout=30) == 0, err_path.read_text()
    spans = [json.loads(line) for line in out_path.read_text().splitlines()]  # stdout holds the spans alone
    logs = [json.loads(line) for line in err_path.read_text().splitlines()]  # stderr the log lines alone
    assert any("Running on http://" in r["message"] and f":{port}" in r["message"] for r in logs), logs
    by_name = {span["name"]: span for span in spans}
    assert {"POST /v1/jobs", "carpool.enqueue"} <= set(by_name), out_path.read_text()
    enqueue = by_name["carpool.enqueue"]
    assert enqueue["context"]["trace_id"] == by_name["POST /v1/jobs"]["context"]["trace_id"]
    assert enqueue["attributes"]["carpool.job.id"] == "console-1"


@pytest.mark.parametrize(("verb", "variable", "value"), [
    ("gateway", "OTEL_TRACES_EXPORTER", "jaeger"),
    ("gateway", "OTEL_METRICS_EXPORTER", "zipkin"),
    ("gateway", "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
    ("webhooks", "OTEL_TRACES_EXPORTER", "jaeger"),
])
def test_an_unsupported_exporter_is_refused(verb: str, variable: str, value: str, redis_url: str) -> None:
    env = _env(CARPOOL_WEBHOOK_SECRET=generate_secret(), CARPOOL_METRICS_PORT="0", **{variable: value})
    args = ["--port", str(free_port())] if verb == "gateway" else []
    done = subprocess.run([sys.executable, "-m", "gateway.cli", verb, "--redis-url", redis_url, *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=20)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"carpool {verb}: ") and variable in lines[0], done.stderr
