"""A Redis that wants a password (`requirepass`): the commands that take a Redis URL reach it with one, and
say in one line that it wants one (or another one) when the URL has none (or a wrong one)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from gateway.cli.embedded_redis import EmbeddedRedis
from tests.harness.up_stack import carpool

PASSWORD = "s3cret"


@pytest.fixture(scope="module")
def password_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A Redis of this module's own whose default user needs `PASSWORD`."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("password-redis"), is_persistent=False).start()
    admin = redis.Redis.from_url(server.url)
    admin.config_set("requirepass", PASSWORD)
    admin.close()
    yield server
    server.stop()


def with_credentials(server: EmbeddedRedis, userinfo: str) -> str:
    return server.url.replace("redis://", f"redis://{userinfo}@", 1)


@pytest.mark.parametrize("userinfo", [f":{PASSWORD}", f"default:{PASSWORD}"])
def test_redis_cli_reaches_a_redis_with_a_password_with_or_without_a_user(password_redis: EmbeddedRedis,
                                                                          userinfo: str) -> None:
    pong = carpool("redis-cli", "--redis-url", with_credentials(password_redis, userinfo), "PING")
    assert (pong.returncode, pong.stdout.strip()) == (0, "PONG"), pong.stdout + pong.stderr
