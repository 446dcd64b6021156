"""One line of a Batch API input file -> a job body, and one finished request -> an output-file line."""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any

import msgpack
from redis.typing import EncodableT, FieldT

from gateway.errors import OpenAIError, openai_error_body
from gateway.openai import responses
from gateway.openai.responses import renamed_in
from gateway.openai.schema import Endpoint, parse_request
from scheduler.protocol.lanes import Lane
from scheduler.protocol.wire_values import is_text, loads_json

ID_PREFIXES = {Endpoint.CHAT: "chatcmpl-", Endpoint.COMPLETIONS: "cmpl-"}


class LineError(Exception):
    """Why an input line cannot run: an OpenAI-style error ``code`` and a message naming the fault; for a request
    the online route would refuse, that answer's ``status`` and ``param`` (the body's field at fault)."""

    def __init__(self, code: str, message: str, *, param: str | None = None, status: int | None = None) -> None:
        # A line's text quoted in the message (a key, a model's name) may hold a lone surrogate, which JSON's
        # escapes allow and no UTF-8 can carry: written escaped, so the error itself can be kept.
        message, param = _escaped(message), None if param is None else _escaped(param)
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.status = status

    def fields(self, number: int) -> dict[FieldT, EncodableT]:
        """The batch error hash's fields for input line `number`: ``"<n>"``, msgpack [code, message], as every
        gateway reads it; and for a refused request ``"<n>:answer"``, msgpack [param, status], which gateways
        before it ignore (a rolling upgrade's older gateway finalizing the batch writes the line without them)."""
        out: dict[FieldT, EncodableT] = {str(number): msgpack.packb([self.code, self.message])}
        if self.param is not None or self.status is not None:
            out[answer_field(number)] = msgpack.packb([self.param, self.status])
        return out


def _escaped(text: str) -> str:
    return text if is_text(text) else text.encode("utf-8", "backslashreplace").decode("utf-8")


def answer_field(number: int) -> str:
    """The error hash's field of line `number`'s answer (see `LineError.fields`)."""
    return f"{number}:answer"


def unpack_error(raw: bytes, answer: bytes | None) -> LineError:
    """A line's error from its two error-hash fields (`LineError.fields`)."""
    code, message, *rest = msgpack.unpackb(raw)  # [code, message, param, status]: one form written before
    param, status = msgpack.unpackb(answer) if answer is not None else (rest + [None, None])[:2]
    return LineError(code, message, param=param, status=status)


def load_line(line: str) -> Any:
    """One input line's JSON; raises ValueError. A byte-order mark, which some editors write at the start of a
    UTF-8 file (so before its first line), is not part of it."""
    return loads_json(line.removeprefix("\ufeff"))


def parse_line(line: str, endpoint: Endpoint) -> tuple[str, dict[str, Any], dict[str, str]]:
    """(custom_id, job body without id, the parameters it spelt its own way: ``OpenAIRequest.renames``) of one
    input line; raises LineError."""
    try:
        data = load_line(line)
    except json.JSONDecodeError as e:
        # The line alone, so no line number of json's own (a line's ending is part of it).
        raise LineError("invalid_json", f"the line is not valid JSON: {e.msg} at character {e.pos + 1}") from e
    except (ValueError, RecursionError) as e:
        raise LineError("invalid_json", f"the line is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise LineError("invalid_json", "the line must be a JSON object")
    custom_id = custom_id_of(data)
    if custom_id is None:
        given = "" if "custom_id" not in data else f", got {json.dumps(data['custom_id'])[:100]}"
        if isinstance(data.get("custom_id"), str) and data["custom_id"]:
            raise LineError("invalid_custom_id", f"custom_id must be Unicode text (it holds a lone surrogate){given}")
        raise LineError("missing_custom_id", f"custom_id is required (a non-empty string){given}")
    if data.get("method", "POST") != "POST":
        raise LineError("invalid_method", f"method must be POST, got {json.dumps(data.get('method'))[:100]}")
    if data.get("url") != endpoint.value:
        given = "it is missing" if "url" not in data else f"got {json.dumps(data['url'])[:100]}"
        raise LineError("invalid_url", f"url must be the batch's endpoint {endpoint.value}; {given}")
    try:
        request = parse_request(endpoint, data.get("body"), default_lane=Lane.BATCH, is_batch=True)
    except OpenAIError as e:
        # The online route's answer, its code and param included; a message about the whole body names it already
        # ("body: must be a JSON object").
        raise LineError(e.code or "invalid_request", e.message if e.param == "body" else f"body: {e.message}",
                        param=e.param, status=e.status) from e
    return custom_id, request.jobs[0], request.renames


def custom_id_of(data: object) -> str | None:
    custom_id = data.get("custom_id") if isinstance(data, dict) else None
    return custom_id if isinstance(custom_id, str) and custom_id and is_text(custom_id) else None


def _line_id() -> str:
    return "batch_req_" + secrets.token_hex(12)


REQUEST_ERROR_STATUS = {"invalid_request": 400, "context_length_exceeded": 400, "model_not_found": 404}
"""Codes of lines that are requests the online route would answer with an HTTP error (this status)."""


def error_line(custom_id: str | None, code: str, message: str, *, status: int | None = None,
               param: str | None = None, request_id: str | None = None) -> str:
    """An error-file line. A request refused or failed as the online route would answer it (`status`, else
    the one of its `code`) has that answer as its ``response``, as OpenAI writes it; a line that is no request
    (not JSON, no ``custom_id``, another method or URL, a repeated ``custom_id``) or a request that never ran
    (``batch_expired``, ``batch_cancelled``) has an ``error`` instead."""
    status = status or REQUEST_ERROR_STATUS.get(code)
    if status is None:
        return json.dumps({"id": _line_id(), "custom_id": custom_id, "response": None,
                           "error": {"code": code, "message": message}})
    return json.dumps({"id": _line_id(), "custom_id": custom_id, "error": None, "response": {
        "status_code": status, "request_id": request_id,
        "body": openai_error_body(status, message, param=param, code=code)}})


def result_line(endpoint: Endpoint, number: int, custom_id: str, view: dict[str, Any],
                renames: Mapping[str, str] | None = None) -> tuple[str, bool]:
    """(the output- or error-file line of the finished job of input line `number` (0-based), whether it goes to
    the output file).

    A failed request's error has the code the online route answers with (``context_length_exceeded`` for a
    prompt too long for the context), names the parameter as the line spelt it (`renames`, from `parse_line`),
    and its message starts ``line N:``, as every error-file message does."""
    status = view.get("status")
    if status == "succeeded":
        job_id = str(view.get("id"))
        model = str((view.get("metadata") or {}).get("model", ""))
        body = responses.completion_object(endpoint, ID_PREFIXES[endpoint] + job_id,
                                           int(view.get("finished_at") or 0), model, [view])
        return json.dumps({"id": _line_id(), "custom_id": custom_id,
                           "response": {"status_code": 200, "request_id": job_id, "body": body},
                           "error": None}), True
    error = view.get("error") or {}
    never_ran = {"cancelled": "batch_cancelled", "expired": "batch_expired"}.get(str(status))
    if never_ran is not None:
        return error_line(custom_id, never_ran, f"line {number + 1}: {error.get('message', status)}"), False
    refused = responses.job_error(view, renames)
    message = renamed_in(str(error.get("message", status)), renames)
    return error_line(custom_id, str(refused.code), f"line {number + 1}: {message}",
                      status=refused.status, param=refused.param, request_id=str(view.get("id"))), False

