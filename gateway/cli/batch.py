"""`carpool batch submit|status|cancel`: the Batch API from the command line, over a gateway's HTTP API."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from gateway.cli.submit import (
    DEFAULT_GATEWAY,
    EXIT_FAILED,
    EXIT_REFUSED,
    EXIT_TIMEOUT,
    NotAGateway,
    add_api_key_flag,
    auth_header,
    error_answer,
    path_part,
    read_json,
    report_failure,
    report_interrupt,
    wait_seconds,
)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
FINAL = ("completed", "failed", "expired", "cancelled")
BAR_WIDTH = 30
STD_STREAM = Path("-")
"""The input file or output path that means standard input or output."""
STDIN_FILENAME = "stdin.jsonl"
"""The name an input read from standard input is uploaded under."""


def add_batch_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    submit = actions.add_parser("submit", help="upload a JSONL file and start a batch")
    submit.add_argument("file", type=Path, help="JSONL, one request per line; - reads it from standard input")
    submit.add_argument("--endpoint", choices=ENDPOINTS, default=None,
                        help="the lines' url (default: the url of the file's first line that names one of these)")
    submit.add_argument("--wait", action="store_true", help="show progress until the batch ends")
    submit.add_argument("-o", "--output", type=Path, default=None,
                        help="wait, then write the output file's lines here (errors go to OUTPUT.errors.jsonl); "
                             "- writes both to standard output, output lines first, and the batch id to stderr")
    submit.add_argument("--timeout-s", type=wait_seconds, default=24 * 3600.0,
                        help="give up waiting after this many seconds (default 86400; the batch goes on)")
    for name, text in (("status", "print a batch"), ("cancel", "cancel a batch")):
        action = actions.add_parser(name, help=text)
        action.add_argument("batch_id")
    for action in actions.choices.values():
        action.add_argument("--gateway", default=env.get("CARPOOL_GATEWAY", DEFAULT_GATEWAY),
                            help=f"gateway base URL (default: {DEFAULT_GATEWAY}) [env CARPOOL_GATEWAY]")
        add_api_key_flag(action, env)


class BatchError(Exception):
    pass


def _call(method: str, url: str, data: bytes | None = None, content_type: str = "application/json",
          api_key: str | None = None) -> bytes:
    headers = {"Content-Type": content_type, **auth_header(api_key)}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return bytes(resp.read())
    except urllib.error.HTTPError as e:
        raise BatchError(f"HTTP {e.code}: {error_answer(e, url)['error']['message']}") from e


def _json(method: str, url: str, body: dict[str, Any] | None = None, api_key: str | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    result: dict[str, Any] = read_json(_call(method, url, data, api_key=api_key), url)
    return result


def upload(base: str, filename: str, data: bytes, api_key: str | None = None) -> str:
    boundary = uuid.uuid4().hex
    parts = [
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n".encode(),
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n"
        "Content-Type: application/jsonl\r\n\r\n".encode(),
        data, f"\r\n--{boundary}--\r\n".encode(),
    ]
    answer = read_json(_call("POST", f"{base}/v1/files", b"".join(parts), f"multipart/form-data; boundary={boundary}",
                             api_key), f"{base}/v1/files")
    return str(answer["id"])


def endpoint_of(data: bytes) -> str:
    """The url the file's first line names (its requests all go to one endpoint), else chat completions."""
    for raw in data.splitlines():
        try:
            url = json.loads(raw).get("url")
        except (ValueError, AttributeError):
            continue
        if url in ENDPOINTS:
            return str(url)
    return ENDPOINTS[0]


class LocalFileError(Exception):
    """A file on this machine that cannot be read or written: said as such, never as a gateway problem."""


def progress_line(batch: dict[str, Any], started: float, start_done: int, start_tokens: int) -> str:
    counts = batch["request_counts"]
    total, done = counts["total"], counts["completed"] + counts["failed"]
    filled = int(BAR_WIDTH * done / total) if total else 0
    elapsed = max(time.monotonic() - started, 1e-9)
    rate = (done - start_done) / elapsed
    tokens_per_s = (_output_tokens(batch) - start_tokens) / elapsed
    eta = f"{(total - done) / rate:.0f}s" if rate > 0 and done < total else "-"
    return (f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {batch['status']:<11} "
            f"{counts['completed']} done / {counts['failed']} failed / {total}  {tokens_per_s:.0f} tok/s  "
            f"{rate:.1f} req/s  ETA {eta}")


def _output_tokens(batch: dict[str, Any]) -> int:
    return int((batch.get("usage") or {}).get("output_tokens") or 0)


def wait(base: str, batch_id: str, timeout_s: float, out: TextIO, api_key: str | None = None) -> dict[str, Any]:
    """Poll until the batch ends: one line redrawn on a terminal, a line per change elsewhere (a log)."""
    started = time.monotonic()
    batch = _json("GET", f"{base}/v1/batches/{path_part(batch_id)}", api_key=api_key)
    start_done = batch["request_counts"]["completed"] + batch["request_counts"]["failed"]
    start_tokens = _output_tokens(batch)
    is_tty = out.isatty()
    last = None
    while True:
        line = progress_line(batch, started, start_done, start_tokens)
        is_final = batch["status"] in FINAL or time.monotonic() - started >= timeout_s
        if is_tty:
            out.write(f"\r{line}  " + ("\n" if is_final else ""))
        elif (batch["status"], batch["request_counts"]) != last or is_final:
            out.write(line + "\n")
        last = (batch["status"], batch["request_counts"])
        out.flush()
        if is_final:
            return batch
        time.sleep(1.0)
        batch = _json("GET", f"{base}/v1/batches/{path_part(batch_id)}", api_key=api_key)


def run_batch(args: argparse.Namespace) -> int:
    base = args.gateway.rstrip("/")
    batch: dict[str, Any] | None = None
    try:
        if args.action == "status":
            print(json.dumps(_json("GET", f"{base}/v1/batches/{path_part(args.batch_id)}", api_key=args.api_key),
                             indent=2))
            return 0
        if args.action == "cancel":
            print(json.dumps(_json("POST", f"{base}/v1/batches/{path_part(args.batch_id)}/cancel",
                                   api_key=args.api_key), indent=2))
            return 0
        data = _read_input(args.file)
        to_stdout = args.output == STD_STREAM
        if args.output is not None and not to_stdout and not args.output.parent.is_dir():
            raise LocalFileError(f"cannot write {args.output}: no directory {args.output.parent}")
        endpoint = args.endpoint or endpoint_of(data)
        file_id = upload(base, STDIN_FILENAME if args.file == STD_STREAM else args.file.name, data, args.api_key)
        batch = _json("POST", f"{base}/v1/batches", {"input_file_id": file_id, "endpoint": endpoint,
                                                     "completion_window": "24h"}, args.api_key)
        # With -o -, standard output holds the result lines alone (for a pipe to jq and the like).
        print(f"carpool batch: {batch['id']}" if to_stdout else batch["id"], flush=True,
              file=sys.stderr if to_stdout else sys.stdout)
        if not args.wait and args.output is None:
            return 0
        batch = wait(base, batch["id"], args.timeout_s, sys.stderr, args.api_key)
        for error in (batch.get("errors") or {}).get("data", []):
            print(f"carpool batch: {batch['status']}: {error['message']}", file=sys.stderr)
        if args.output is not None:
            for key, path in (("output_file_id", args.output), ("error_file_id", args.output.with_suffix(".errors.jsonl"))):
                if batch.get(key):
                    content = _call("GET", f"{base}/v1/files/{batch[key]}/content", api_key=args.api_key)
                    if to_stdout:
                        sys.stdout.buffer.write(content if content.endswith(b"\n") or not content else content + b"\n")
                        sys.stdout.buffer.flush()
                        continue
                    _write_output(path, content, batch[key])
                    print(f"wrote {path}", file=sys.stderr)
    except LocalFileError as e:
        print(f"carpool batch: {e}", file=sys.stderr)
        return EXIT_FAILED
    except BatchError as e:
        print(f"carpool batch: refused: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except (NotAGateway, urllib.error.URLError, OSError, ValueError) as e:
        return report_failure("batch", base, e)
    except KeyboardInterrupt:
        return report_interrupt("batch", None if batch is None else (
            f"batch {batch['id']} goes on (carpool batch status {batch['id']}; carpool batch cancel {batch['id']})"))
    if batch["status"] not in FINAL:
        print(f"carpool batch: batch {batch['id']} still {batch['status']} after {args.timeout_s:g}s; it goes on "
              f"(carpool batch status {batch['id']})", file=sys.stderr)
        return EXIT_TIMEOUT
    return 0 if batch["status"] == "completed" else EXIT_FAILED


def _read_input(path: Path) -> bytes:
    if path == STD_STREAM:
        return sys.stdin.buffer.read()
    try:
        return path.read_bytes()
    except OSError as e:
        raise LocalFileError(f"cannot read {path}: {e.strerror or e}") from e


def _write_output(path: Path, data: bytes, file_id: str) -> None:
    try:
        path.write_bytes(data)
    except OSError as e:
        raise LocalFileError(f"cannot write {path}: {e.strerror or e} (the gateway keeps it as file {file_id})") from e
