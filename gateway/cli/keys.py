"""`carpool keys create|list|revoke`: API keys, written straight to Redis (keys take effect when a gateway
runs with ``--api-keys``). The key is printed once, at creation; Redis keeps only its SHA-256."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping
from pathlib import Path

import redis

from gateway.api_keys import KeyStore
from gateway.cli.redis_cli import cannot_reach, choose_redis_url
from scheduler.protocol.keys import DEFAULT_PREFIX, Keys
from scheduler.protocol.redis_client import connect as connect_redis
from scheduler.protocol.redis_client import redacted_url, refusal_reason
from scheduler.protocol.tenants import parse_limits


def add_keys_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="make a key for a tenant and print it (shown only this once)")
    create.add_argument("--tenant", required=True, help="the tenant the key acts for (letters, digits, . _ -)")
    create.add_argument("--limits", default="", help=(
        "comma-separated NAME=N: rpm (requests per minute), tpm (tokens per minute: prompt + max_tokens, "
        "settled to the real count), max_queued (jobs waiting or running), weight (fair share in a lane, "
        "default 1); unset means unlimited. Example: rpm=60,tpm=40000,max_queued=100,weight=2"))
    actions.add_parser("list", help="list keys (id, tenant, limits; never the key)")
    revoke = actions.add_parser("revoke", help="revoke a key by its id; every gateway refuses it from then on")
    revoke.add_argument("key_id")
    # The connection flags go before the action (`keys --data-dir D list`, as a data directory names a deployment)
    # or after it; given in both places, the one after the action wins. Only `keys` itself sets their defaults:
    # an action's parser, whose defaults would overwrite what was given before it, sets only what it was given.
    for target in (parser, *actions.choices.values()):
        is_action = target is not parser
        # No defaults from the environment for these two: a flag beats both variables (`choose_redis_url`).
        target.add_argument("--redis-url", default=argparse.SUPPRESS if is_action else None,
                            help="Redis of the deployment (default: carpool up's) [env CARPOOL_REDIS_URL]")
        target.add_argument("--data-dir", default=argparse.SUPPRESS if is_action else None,
                            help="the data directory of the `carpool up` whose Redis to use, when it was started "
                                 "with --data-dir (default ~/.local/share/carpool) [env CARPOOL_DATA_DIR]")
        target.add_argument("--key-prefix",
                            default=argparse.SUPPRESS if is_action else env.get("CARPOOL_KEY_PREFIX", DEFAULT_PREFIX),
                            help=f"prefix of every Redis key (default: {DEFAULT_PREFIX}) [env CARPOOL_KEY_PREFIX]")
        target.add_argument("--json", action="store_true", default=argparse.SUPPRESS if is_action else False,
                            help="print JSON")


def run_keys(args: argparse.Namespace, env: Mapping[str, str], default_data_dir: Path) -> int:
    redis_url = ""
    try:
        redis_url = choose_redis_url(args.redis_url, args.data_dir, env, default_data_dir)
        return asyncio.run(_run(args, redis_url))
    except ValueError as e:
        print(f"carpool keys: {e}", file=sys.stderr)
        return 2
    except redis.AuthenticationError as e:  # a ConnectionError too, but Redis was reached
        print(f"carpool keys: Redis at {redacted_url(redis_url)} refuses it: {refusal_reason(e)}", file=sys.stderr)
        return 1
    except (redis.ConnectionError, redis.TimeoutError) as e:
        print(f"carpool keys: {cannot_reach(redis_url, e)}", file=sys.stderr)
        return 1
    except redis.RedisError as e:  # something answered, but not as a Redis that takes these commands
        print(f"carpool keys: Redis at {redacted_url(redis_url)} failed: {type(e).__name__}: {e}; is that address a Redis server "
              "(--redis-url)?", file=sys.stderr)
        return 1


async def _run(args: argparse.Namespace, redis_url: str) -> int:
    client = connect_redis(redis_url)
    store = KeyStore(client, Keys(args.key_prefix))
    try:
        if args.action == "create":
            key, record = await store.create(args.tenant, parse_limits(args.limits))
            if args.json:
                print(json.dumps({"key": key, **record.to_json()}))
            else:
                print(key)
                print(f"id {record.id}, tenant {record.tenant}; the key is shown only now: keep it safe",
                      file=sys.stderr)
            return 0
        if args.action == "list":
            keys = await store.list()
            if args.json:
                print(json.dumps([k.to_json() for k in keys]))
            else:
                for k in keys:
                    limits = ",".join(f"{n}={v}" for n, v in k.limits.to_json().items() if v is not None)
                    print(f"{k.id}\t{k.tenant}\t{limits}")
            return 0
        assert args.action == "revoke", args.action
        if not await store.revoke(args.key_id):
            print(f"carpool keys: no key {args.key_id!r}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps({"id": args.key_id, "revoked": True}))
        else:
            print(f"revoked {args.key_id}", file=sys.stderr)
        return 0
    finally:
        await client.aclose()
