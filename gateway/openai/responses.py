"""Job records (their public views) -> OpenAI response objects, chunks and errors.

Logprobs name tokens as the worker's tokenizer does (``token``, and its UTF-8
``bytes``), as OpenAI shows them; a logprob of minus infinity is sent as
-9999.0, OpenAI's value for it.
"""

from __future__ import annotations

import codecs
import math
import re
from collections.abc import Mapping
from typing import Any

from gateway.errors import NO_RETRY, OpenAIError
from gateway.openai.schema import Endpoint

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""OpenAI's error code for a prompt (or prompt + max_tokens) longer than the model's context."""
FIELD_PREFIXES = (("params.", ""), ("prompt_token_ids", "prompt"), ("metadata.metadata", "metadata"),
                  ("metadata.user", "user"))
"""A job field's start -> the OpenAI parameter's (where they differ): ``prompt_token_ids[3]`` is ``prompt[3]``,
``metadata.metadata.k`` (a request's own metadata, kept in the job's) is ``metadata.k``."""


def openai_param(field: str, renames: Mapping[str, str] | None = None) -> str:
    """The OpenAI parameter a job field came from; `renames` (``OpenAIRequest.renames``) names the ones a
    request spelt its own way (``max_completion_tokens`` for ``max_tokens``)."""
    param = field
    for start, given_as in FIELD_PREFIXES:
        if field.startswith(start):
            param = given_as + field.removeprefix(start)
            break
    return (renames or {}).get(param, param)


def renamed_in(message: str, renames: Mapping[str, str] | None) -> str:
    """`message` with the parameters a request spelt its own way named as it spelt them."""
    for param, given_as in (renames or {}).items():
        message = re.sub(rf"\b{re.escape(param)}\b", given_as, message)
    return message
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "stop"}
_INVALID_ERRORS = {"invalid_job", "invalid_request", "unadmittable"}


def finish_reason(view: dict[str, Any]) -> str:
    output = view.get("output") or {}
    return FINISH_REASONS.get(output.get("finish_reason") or "stop", "stop")


def usage(views: list[dict[str, Any]]) -> dict[str, Any]:
    """Prompt tokens once (every choice shares the prompt), completion tokens of every choice."""
    counts = [v.get("usage") or {} for v in views]
    prompt = int(counts[0].get("prompt_tokens", 0)) if counts else 0
    completion = sum(int(c.get("completion_tokens", 0)) for c in counts)
    cached = int(counts[0].get("cached_tokens", 0) or 0) if counts else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_object(endpoint: Endpoint, request_id: str, created: int, model: str,
                      views: list[dict[str, Any]]) -> dict[str, Any]:
    choices = []
    for index, view in enumerate(views):
        output = view.get("output") or {}
        logprobs = output.get("logprobs")
        if endpoint is Endpoint.CHAT:
            choices.append({"index": index, "message": {"role": "assistant", "content": output.get("text", ""),
                                                        "refusal": None},
                            "logprobs": None if logprobs is None else chat_logprobs(logprobs),
                            "finish_reason": finish_reason(view)})
        else:
            choices.append({"index": index, "text": output.get("text", ""),
                            "logprobs": None if logprobs is None else completion_logprobs(
                                logprobs, output.get("text", "")),
                            "finish_reason": finish_reason(view)})
    obj = "chat.completion" if endpoint is Endpoint.CHAT else "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices,
            "usage": usage(views), "system_fingerprint": None}


def chunk(endpoint: Endpoint, request_id: str, created: int, model: str, index: int, *, text: str = "",
          role: str | None = None, finish: str | None = None, include_usage: bool = False) -> dict[str, Any]:
    """One choice's chunk; with ``stream_options.include_usage``, ``usage: null`` on it as on every chunk
    before the last, as OpenAI sends them."""
    if endpoint is Endpoint.CHAT:
        delta: dict[str, Any] = {} if role is None and not text and finish else {"content": text}
        if role is not None:
            delta["role"] = role
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        out = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [choice]}
    else:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        out = {"id": request_id, "object": "text_completion", "created": created, "model": model,
               "choices": [choice]}
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(endpoint: Endpoint, request_id: str, created: int, model: str,
                views: list[dict[str, Any]]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if endpoint is Endpoint.CHAT else "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(views)}


UNLIKELY_LOGPROB = -9999.0
"""What OpenAI sends for a logprob of minus infinity (JSON has no infinity)."""


def _logprob(value: object) -> float:
    number = float(value) if isinstance(value, (int, float)) else UNLIKELY_LOGPROB
    return number if math.isfinite(number) else UNLIKELY_LOGPROB


def _named(entry: dict[str, Any]) -> tuple[str, list[int] | None]:
    """(token string, bytes) of a logprobs entry; a record from a worker that named no tokens gives the id."""
    token = entry.get("token")
    if isinstance(token, str):
        return token, list(entry.get("bytes") or [])
    return f"token_id:{entry['token_id']}", None


def _chat_entry(entry: dict[str, Any]) -> dict[str, Any]:
    token, data = _named(entry)
    return {"token": token, "logprob": _logprob(entry.get("logprob")), "bytes": data}


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"content": [{**_chat_entry(e), "top_logprobs": [_chat_entry(t) for t in e.get("top_logprobs") or []]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list[dict[str, Any]], text: str) -> dict[str, Any]:
    """The legacy shape; ``text_offset`` is each token's first character in the text (a token that starts inside
    a character starts where that character does; a special token, which the text leaves out, where the next
    token does)."""
    tokens = [b"" if e.get("special") else bytes(_named(e)[1] or b"") for e in entries]
    stream = b"".join(tokens)
    offsets, num_chars, start = [], 0, 0
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    for data in tokens:
        held = decoder.getstate()[0]
        offsets.append(min(len(text), num_chars + _replaced_before(held, stream[start:start + 3])))
        num_chars += len(decoder.decode(data))
        start += len(data)
    return {
        "tokens": [_named(e)[0] for e in entries],
        "token_logprobs": [_logprob(e.get("logprob")) for e in entries],
        "top_logprobs": [_legacy_top(e) for e in entries],
        "text_offset": offsets,
    }


def _legacy_top(entry: dict[str, Any]) -> dict[str, float]:
    """A token's most likely alternatives and, as OpenAI's legacy completions always add it, the sampled token
    itself when it is not among them (so up to ``logprobs`` + 1 entries; ``logprobs: 0`` gives it alone)."""
    top = {_named(t)[0]: _logprob(t.get("logprob")) for t in entry.get("top_logprobs") or []}
    top.setdefault(_named(entry)[0], _logprob(entry.get("logprob")))
    return top


def _replaced_before(held: bytes, following: bytes) -> int:
    """Characters that the bytes a UTF-8 decoder holds back (the start of a character) turn into before the
    next token's bytes: none when the next byte carries the character on (the next token starts inside it, be
    the character completed or, cut short later, one U+FFFD), one U+FFFD when it cannot or none follows (the
    text's end)."""
    if not held:
        return 0
    if not following:
        return 1
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(held + following[:1])
    except UnicodeDecodeError:
        return 1
    return 0


def job_error(view: dict[str, Any], renames: Mapping[str, str] | None = None) -> OpenAIError:
    """Why a choice's job did not succeed, as the HTTP error its request gets (`renames`: see `openai_param`)."""
    error = view.get("error") or {}
    kind, message = str(error.get("type", view.get("status"))), str(error.get("message", view.get("status")))
    if kind in _INVALID_ERRORS:
        field = error.get("field")
        param = None if field is None else openai_param(str(field), renames)
        return OpenAIError(400, renamed_in(message, renames), param=param, code=str(error.get("code") or kind))
    # The openai client retries 408 and 409 by default, which would enqueue the request again: a job
    # cancelled by someone, or past its deadline, is an answer, and `x-should-retry: false` tells it so.
    if view.get("status") == "cancelled":
        return OpenAIError(409, f"the request's job was cancelled: {message}", code="cancelled", headers=NO_RETRY)
    if view.get("status") == "expired":
        return OpenAIError(408, message, code="expired", headers=NO_RETRY)
    return OpenAIError(500, f"generation failed: {message}", code=kind)
