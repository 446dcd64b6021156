"""`carpool submit "text"`: post one job to a gateway over HTTP and, with `--wait`, print its completion."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

from gateway.cli import EXIT_INTERRUPTED
from scheduler.params import SamplingParams
from scheduler.protocol.job import JobStatus
from scheduler.protocol.lanes import DEFAULT_LANE, LANES
from scheduler.runtime.model_path import BUILTIN_MODEL_NOTICE
from scheduler.runtime.terminal import printable, prompt_argument

DEFAULT_GATEWAY = "http://127.0.0.1:8000"
POLL_CHUNK_S = 30.0
"""Longest single long-poll; the gateway caps ?wait= anyway."""

EXIT_FAILED = 1
EXIT_REFUSED = 2
EXIT_TIMEOUT = 3
EXIT_READER_GONE = 141
"""Whoever read standard output stopped reading (`| head`), as a shell reports a process ended by SIGPIPE."""


def add_submit_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    parser.add_argument("text", help="prompt text; - reads it from standard input")
    parser.add_argument("--lane", choices=[lane.value for lane in LANES], default=DEFAULT_LANE.value,
                        help=f"the priority lane (default {DEFAULT_LANE.value})")
    parser.add_argument("--wait", action="store_true", help="wait for the job to finish and print its text")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"most tokens to generate (default {SamplingParams().max_tokens}, a job's default)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 is greedy (default, as for carpool generate: the same prompt prints the same text; "
                             "a job's own default is 1.0)")
    parser.add_argument("--seed", type=int, default=None, help="seed of a sampled draw (default: none, unseeded)")
    parser.add_argument("--priority", type=int, default=None, help="within the lane; lower runs first")
    parser.add_argument("--id", dest="job_id", default=None, help="job id (default: the gateway makes one)")
    parser.add_argument("--idempotency-key", default=None, help="sent as the Idempotency-Key header")
    parser.add_argument("--json", action="store_true", help="print the whole job record as JSON")
    parser.add_argument(
        "--gateway", default=env.get("CARPOOL_GATEWAY", DEFAULT_GATEWAY),
        help=f"gateway base URL (default: {DEFAULT_GATEWAY}) [env CARPOOL_GATEWAY]",
    )
    parser.add_argument("--timeout-s", type=wait_seconds, default=600.0,
                        help="give up waiting after this many seconds (default 600; the job goes on)")
    add_api_key_flag(parser, env)


def wait_seconds(text: str) -> float:
    """A `--timeout-s` value: seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text!r}")
    return value


def add_api_key_flag(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    parser.add_argument("--api-key", default=env.get("CARPOOL_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (gateways run with --api-keys) [env CARPOOL_API_KEY]")


def auth_header(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def job_body(args: argparse.Namespace, prompt: str) -> dict[str, Any]:
    params = {name: getattr(args, name) for name in ("max_tokens", "temperature", "seed") if getattr(args, name) is not None}
    body: dict[str, Any] = {"prompt": prompt, "lane": args.lane, "params": params}
    if args.priority is not None:
        body["priority"] = args.priority
    if args.job_id is not None:
        body["id"] = args.job_id
    return body


class NotAGateway(Exception):
    """An answer that is not a carpool gateway's: not JSON, or an error that is not in its error shape."""


def read_json(data: bytes, url: str) -> Any:
    """The JSON of an answer from `url`; raises `NotAGateway` for anything else (an HTML page, a proxy's text)."""
    try:
        return json.loads(data)
    except ValueError:
        raise NotAGateway(f"the answer from {url} is not JSON: does --gateway name a carpool gateway?") from None


def path_part(value: str) -> str:
    """A job or batch id as one URL path segment (ids may hold `/`, `?`, `#`, `%` or any printable character)."""
    return urllib.parse.quote(value, safe="")


def report_failure(verb: str, base: str, error: Exception) -> int:
    """Say in one line why a request to the gateway at `base` failed other than by its refusal; the exit status.

    A `BrokenPipeError` is no failure of the gateway's but our reader's, gone (`| head`): raised again for `main`,
    which ends quietly."""
    if isinstance(error, NotAGateway):
        message, status = str(error), EXIT_FAILED
    elif isinstance(error, BrokenPipeError):  # our own standard output's reader, not the gateway (urllib's are URLError)
        raise error
    elif isinstance(error, (urllib.error.URLError, OSError)):
        message, status = f"cannot reach the gateway at {base}: {error}", EXIT_FAILED
    else:  # ValueError: a --gateway that is no URL, a header value HTTP cannot carry
        message, status = str(error), EXIT_REFUSED
    print(f"carpool {verb}: {message}", file=sys.stderr)
    return status


def report_interrupt(verb: str, what_goes_on: str | None) -> int:
    """Ctrl-C during a request or a wait: one line, naming what was made and goes on; the shell's exit status."""
    print(f"carpool {verb}: interrupted" + ("" if what_goes_on is None else f"; {what_goes_on}"), file=sys.stderr)
    return EXIT_INTERRUPTED


class GatewayError(Exception):
    """The gateway's refusal: its status, the field it names and its message, and when to try again where it
    says so (``Retry-After``, with a 429 or a 503)."""

    def __init__(self, status: int, body: dict[str, Any], retry_after: str | None = None) -> None:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        where = f" ({error['field']})" if error.get("field") else ""
        again = f" (try again in {retry_after} s)" if retry_after is not None and retry_after.isdigit() else ""
        super().__init__(f"HTTP {status}{where}: {error.get('message', body)}{again}")
        self.status = status


def _request(method: str, url: str, body: dict[str, Any] | None, headers: dict[str, str], timeout_s: float) -> dict[str, Any]:
    return _send(method, url, body, headers, timeout_s)[1]


def _send(method: str, url: str, body: dict[str, Any] | None, headers: dict[str, str],
          timeout_s: float) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON answer) of a request that succeeded; raises `GatewayError` for an error answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, read_json(resp.read(), url)
    except urllib.error.HTTPError as e:
        raise GatewayError(e.code, error_answer(e, url), e.headers.get("Retry-After")) from e


def error_answer(error: urllib.error.HTTPError, url: str) -> dict[str, Any]:
    """The JSON of a carpool gateway's error answer (``{"error": {"message": ...}}``, the OpenAI shape); raises
    `NotAGateway` for any other (a 404 page of another web server, a proxy's 502), so that no such answer is
    reported as the gateway refusing the request."""
    try:
        payload = json.loads(error.read())
    except ValueError:
        payload = None
    if not (isinstance(payload, dict) and isinstance(payload.get("error"), dict)
            and isinstance(payload["error"].get("message"), str)):
        raise NotAGateway(f"the answer from {url} (HTTP {error.code}) is no carpool gateway's error: does --gateway "
                          "name a carpool gateway?") from None
    return payload


def run_submit(args: argparse.Namespace) -> int:
    try:
        prompt = prompt_argument(args.text, sys.stdin.buffer)
    except ValueError as e:
        print(f"carpool submit: {e}", file=sys.stderr)
        return EXIT_REFUSED
    base = args.gateway.rstrip("/")
    headers = auth_header(args.api_key)
    if args.idempotency_key:
        headers["Idempotency-Key"] = args.idempotency_key
    created: dict[str, Any] | None = None
    try:
        status, created = _send("POST", f"{base}/v1/jobs", job_body(args, prompt), headers, timeout_s=30)
        if status == 200:  # 202 makes a job; 200 answers with the one the id or key already names
            print(f"carpool submit: job {created['id']} already existed (its id or Idempotency-Key named it): this is "
                  "that job, not a new one", file=sys.stderr)
        if not args.wait:
            print(json.dumps(created) if args.json else created["id"])
            return 0
        view = _wait(base, created["id"], args.timeout_s, auth_header(args.api_key))
    except GatewayError as e:
        print(f"carpool submit: refused: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except (NotAGateway, urllib.error.URLError, OSError, ValueError) as e:
        return report_failure("submit", base, e)
    except KeyboardInterrupt:
        url = None if created is None else f"{base}/v1/jobs/{path_part(created['id'])}"
        return report_interrupt("submit", None if created is None else (
            f"job {created['id']} goes on (see it: curl {url}; cancel it: curl -X DELETE {url})"))
    if args.json:
        print(json.dumps(view, indent=2))
    status = view["status"]
    if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED) and _is_builtin_model(base, view.get("worker")):
        print(f"carpool submit: {BUILTIN_MODEL_NOTICE}", file=sys.stderr)
    if status == JobStatus.SUCCEEDED:
        if not args.json:
            print(printable(view["output"]["text"]))
        return 0
    if status in (JobStatus.QUEUED, JobStatus.RUNNING):
        print(f"carpool submit: job {view['id']} still {status} after {args.timeout_s:g}s", file=sys.stderr)
        return EXIT_TIMEOUT
    error = view.get("error") or {}
    print(f"carpool submit: job {view['id']} {status}: {error.get('message', '')}", file=sys.stderr)
    return EXIT_FAILED


def _is_builtin_model(base: str, worker: object) -> bool:
    """Whether the worker that ran the job says (in its heartbeat, on /readyz) it serves the built-in model."""
    if not isinstance(worker, str):
        return False
    try:
        ready = _request("GET", f"{base}/readyz", None, {}, timeout_s=10)
    except (GatewayError, NotAGateway, urllib.error.URLError, OSError, ValueError):
        return False  # only a note: never fail a finished job over it (a 503 /readyz, a proxy's 404 page)
    workers = ready.get("workers") if isinstance(ready, dict) else None
    beat = workers.get(worker) if isinstance(workers, dict) else None
    return isinstance(beat, dict) and beat.get("builtin_model") is True


def _wait(base: str, job_id: str, timeout_s: float, headers: dict[str, str]) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        chunk = max(0.0, min(POLL_CHUNK_S, remaining))
        view = _request("GET", f"{base}/v1/jobs/{path_part(job_id)}?wait={chunk:.1f}", None, headers,
                        timeout_s=chunk + 30)
        if view["status"] not in (JobStatus.QUEUED, JobStatus.RUNNING) or remaining <= 0:
            return view
