"""`carpool submit "text"`: post one job to a gateway over HTTP and, with `--wait`, print its completion."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from scheduler.checkpoint import BUILTIN_MODEL_NOTICE
from scheduler.lanes import DEFAULT_LANE, LANES

DEFAULT_GATEWAY = "http://127.0.0.1:8000"
POLL_CHUNK_S = 30.0
"""Longest single long-poll; the gateway caps ?wait= anyway."""

EXIT_FAILED = 1
EXIT_REFUSED = 2
EXIT_TIMEOUT = 3


def add_submit_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    parser.add_argument("text", help="prompt text")
    parser.add_argument("--lane", choices=[lane.value for lane in LANES], default=DEFAULT_LANE.value)
    parser.add_argument("--wait", action="store_true", help="wait for the job to finish and print its text")
    parser.add_argument("--max-tokens", type=int, default=None, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 is greedy (default, as for carpool generate: the same prompt prints the same text; "
                             "a job's own default is 1.0)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--priority", type=int, default=None, help="within the lane; lower runs first")
    parser.add_argument("--id", dest="job_id", default=None, help="job id (default: the gateway makes one)")
    parser.add_argument("--idempotency-key", default=None, help="sent as the Idempotency-Key header")
    parser.add_argument("--json", action="store_true", help="print the whole job record as JSON")
    parser.add_argument(
        "--gateway", default=env.get("CARPOOL_GATEWAY", DEFAULT_GATEWAY),
        help=f"gateway base URL (default: {DEFAULT_GATEWAY}) [env CARPOOL_GATEWAY]",
    )
    parser.add_argument("--timeout-s", type=float, default=600.0, help="give up waiting after this many seconds")
    add_api_key_flag(parser, env)


def add_api_key_flag(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    parser.add_argument("--api-key", default=env.get("CARPOOL_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (gateways run with --api-keys) [env CARPOOL_API_KEY]")


def auth_header(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def job_body(args: argparse.Namespace) -> dict[str, Any]:
    params = {name: getattr(args, name) for name in ("max_tokens", "temperature", "seed") if getattr(args, name) is not None}
    body: dict[str, Any] = {"prompt": args.text, "lane": args.lane, "params": params}
    if args.priority is not None:
        body["priority"] = args.priority
    if args.job_id is not None:
        body["id"] = args.job_id
    return body


class GatewayError(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        where = f" ({error['field']})" if error.get("field") else ""
        super().__init__(f"HTTP {status}{where}: {error.get('message', body)}")
        self.status = status


def _request(method: str, url: str, body: dict[str, Any] | None, headers: dict[str, str], timeout_s: float) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            payload = json.loads(e.read())
        except ValueError:
            payload = {}
        raise GatewayError(e.code, payload) from e


def run_submit(args: argparse.Namespace) -> int:
    base = args.gateway.rstrip("/")
    headers = auth_header(args.api_key)
    if args.idempotency_key:
        headers["Idempotency-Key"] = args.idempotency_key
    try:
        created = _request("POST", f"{base}/v1/jobs", job_body(args), headers, timeout_s=30)
        if not args.wait:
            print(json.dumps(created) if args.json else created["id"])
            return 0
        view = _wait(base, created["id"], args.timeout_s, auth_header(args.api_key))
    except GatewayError as e:
        print(f"carpool submit: refused: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except (urllib.error.URLError, OSError) as e:
        print(f"carpool submit: cannot reach the gateway at {base}: {e}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(view, indent=2))
    status = view["status"]
    if status in ("succeeded", "failed", "cancelled") and _is_builtin_model(base, view.get("worker")):
        print(f"carpool submit: {BUILTIN_MODEL_NOTICE}", file=sys.stderr)
    if status == "succeeded":
        if not args.json:
            print(printable(view["output"]["text"]))
        return 0
    if status in ("queued", "running"):
        print(f"carpool submit: job {view['id']} still {status} after {args.timeout_s:g}s", file=sys.stderr)
        return EXIT_TIMEOUT
    error = view.get("error") or {}
    print(f"carpool submit: job {view['id']} {status}: {error.get('message', '')}", file=sys.stderr)
    return EXIT_FAILED


def printable(text: str) -> str:
    """``text`` with control and other non-printable characters escaped, so a terminal shows them as such."""
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode() for c in text)


def _is_builtin_model(base: str, worker: object) -> bool:
    """Whether the worker that ran the job says (in its heartbeat, on /readyz) it serves the built-in model."""
    if not isinstance(worker, str):
        return False
    try:
        ready = _request("GET", f"{base}/readyz", None, {}, timeout_s=10)
    except (GatewayError, urllib.error.URLError, OSError, ValueError):
        return False  # only a note: never fail a finished job over it
    beat = ready.get("workers", {}).get(worker)
    return isinstance(beat, dict) and beat.get("builtin_model") is True


def _wait(base: str, job_id: str, timeout_s: float, headers: dict[str, str]) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        chunk = max(0.0, min(POLL_CHUNK_S, remaining))
        view = _request("GET", f"{base}/v1/jobs/{job_id}?wait={chunk:.1f}", None, headers, timeout_s=chunk + 30)
        if view["status"] not in ("queued", "running") or remaining <= 0:
            return view
