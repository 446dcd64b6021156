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


@pytest.mark.parametrize(("userinfo", "words"), [
    ("", "Redis needs a password, and the URL has none"),
    (":wrong", "the URL's password, or its user, is wrong (invalid username-password pair"),
])
@pytest.mark.parametrize("argv", [["keys", "list"], ["gateway", "--port", "0"], ["worker", "--metrics-port", "0"]])
def test_a_missing_or_wrong_password_is_said_as_such_in_one_line(password_redis: EmbeddedRedis, userinfo: str,
                                                                 words: str, argv: list[str]) -> None:
    url = with_credentials(password_redis, userinfo) if userinfo else password_redis.url
    done = carpool(*argv, "--redis-url", url)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.strip()]
    assert line.startswith(f"carpool {argv[0]}: Redis at redis://") and words in line, line
    assert "cannot reach" not in line and "HELLO" not in line and "wrong@" not in line, line
