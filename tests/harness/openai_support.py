"""A gateway on a real port and an in-loop worker (or worker processes), spoken to with the real `openai` client."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from gateway.app import init_app
from gateway.config import GatewayConfig
from tests.harness.child_env import child_pythonpath
from tests.harness.gateway_server import GatewayTestServer
from tests.harness.worker_harness import running_worker

MODEL_NAME = "tiny"
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Service:
    url: str
    client: openai.AsyncOpenAI


@asynccontextmanager
async def gateway_server(redis_url: str, **settings: Any) -> AsyncIterator[str]:
    """The gateway's app on a free 127.0.0.1 port; yields its base URL."""
    config = GatewayConfig(redis_url=redis_url, **{"no_webhooks": True, **settings})
    server = GatewayTestServer(init_app(config), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@asynccontextmanager
async def openai_service(redis_url: str, engine: Any | None, **gateway_settings: Any) -> AsyncIterator[Service]:
    """Gateway + (when `engine` is given) a worker serving it as MODEL_NAME + an AsyncOpenAI client."""
    async with gateway_server(redis_url, **gateway_settings) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            if engine is None:
                yield Service(url, client)
            else:
                async with running_worker(redis_url, engine, served_model_name=MODEL_NAME, heartbeat_interval_s=0.2):
                    yield Service(url, client)
        finally:
            await client.close()


def start_worker(redis_url: str, model: str, name: str, log_path: Path) -> subprocess.Popen[bytes]:
    """A worker process serving MODEL_NAME, with a short lease and frequent checkpoints (for SIGKILL tests)."""
    args = [sys.executable, "-m", "worker.cli", "worker", "--redis-url", redis_url, "--model", model,
            "--served-model-name", MODEL_NAME, "--worker-name", name, "--metrics-port", "0", "--max-num-seqs", "8",
            "--lease-s", "2", "--checkpoint-tokens", "4", "--checkpoint-interval-s", "0.2", "--max-wait-ms", "5"]
    env = {**os.environ, "PYTHONPATH": child_pythonpath(ROOT)}
    with open(log_path, "ab") as log:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
