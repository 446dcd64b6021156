"""Shared fixtures: a real redis-server process and real tiny models on disk."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from gateway.app import init_app
from gateway.cli.embedded_redis import EmbeddedRedis
from gateway.config import GatewayConfig
from tests.harness.gateway_server import GatewayTestServer

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Nothing here imports torch, so the pure scheduler tests (tests/scheduler/) run without it. The folders
# whose tests load torch set it up in their own conftest (tests/harness/torch_setup.py).


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """`-n auto`: a process more than the cores (up to `--maxprocesses`): about a fifth of the suite's time is
    spent waiting (on leases, timeouts, Redis, child processes starting), which the extra process fills. On
    two cores, three processes ran the suite in 355 s where two took 395 s. `-n logical` and
    PYTEST_XDIST_AUTO_NUM_WORKERS keep their meaning (None: xdist decides)."""
    if config.option.numprocesses != "auto" or os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores + 1


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), is_persistent=False).start()
    yield server
    server.stop()


@pytest.fixture
async def gateway_url(redis_url: str) -> AsyncIterator[str]:
    """Base URL of a real gateway (no webhook dispatcher) on a free 127.0.0.1 port, over the session's Redis."""
    server = GatewayTestServer(init_app(GatewayConfig(redis_url=redis_url, no_webhooks=True)), host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    """URL of the session's redis-server, emptied before each test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """`tiny_model(arch="llama", **config_overrides)` -> path of a saved random-weight checkpoint.

    Built once per (arch, overrides) per test session with `create_tiny_model`,
    which writes a transformers config, random weights and a byte-level
    tokenizer with `save_pretrained`; tests load it back by path.
    """
    from worker.engine.default_model import create_tiny_model

    cache: dict[tuple[str, tuple[tuple[str, object], ...]], str] = {}
    root = tmp_path_factory.mktemp("models")

    def make(arch: str = "llama", **overrides: object) -> str:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            path = Path(root) / f"{arch}-{len(cache)}"
            cache[key] = str(create_tiny_model(path, arch=arch, **overrides))
        return cache[key]

    return make


@pytest.fixture(name="redis")
async def async_redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """An asyncio client of the session's redis-server (emptied for this test), closed afterwards."""
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def cycling_model(tiny_model: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama whose greedy continuation follows fixed cycles over the printable ids
    (``bench.repetitive.make_cycling_model``): prompts that are spans of a cycle get copied."""
    from bench.repetitive import make_cycling_model

    return str(make_cycling_model(tiny_model("llama"), tmp_path_factory.mktemp("cycling") / "model"))
