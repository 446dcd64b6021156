"""Job records (their public views) -> OpenAI response objects, chunks and errors.

Token strings live in the worker's tokenizer, which the gateway does not load,
so logprobs name tokens by id as ``"token_id:<id>"`` (vLLM's
``return_tokens_as_token_ids`` form).
"""

from __future__ import annotations

from typing import Any

from gateway.errors import OpenAIError
from gateway.openai.schema import Endpoint

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
            choices.append({"index": index, "message": {"role": "assistant", "content": output.get("text", "")},
                            "logprobs": None if logprobs is None else chat_logprobs(logprobs),
                            "finish_reason": finish_reason(view)})
        else:
            choices.append({"index": index, "text": output.get("text", ""),
                            "logprobs": None if logprobs is None else completion_logprobs(logprobs),
                            "finish_reason": finish_reason(view)})
    obj = "chat.completion" if endpoint is Endpoint.CHAT else "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices,
            "usage": usage(views), "system_fingerprint": None}


def chunk(endpoint: Endpoint, request_id: str, created: int, model: str, index: int, *, text: str = "",
          role: str | None = None, finish: str | None = None) -> dict[str, Any]:
    if endpoint is Endpoint.CHAT:
        delta: dict[str, Any] = {} if role is None and not text and finish else {"content": text}
        if role is not None:
            delta["role"] = role
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]}
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def usage_chunk(endpoint: Endpoint, request_id: str, created: int, model: str,
                views: list[dict[str, Any]]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if endpoint is Endpoint.CHAT else "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(views)}


def _token(token_id: int) -> str:
    return f"token_id:{token_id}"


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"content": [
        {"token": _token(e["token_id"]), "logprob": e["logprob"], "bytes": None,
         "top_logprobs": [{"token": _token(t["token_id"]), "logprob": t["logprob"], "bytes": None}
                          for t in e.get("top_logprobs") or []]}
        for e in entries
    ]}


def completion_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "tokens": [_token(e["token_id"]) for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{_token(t["token_id"]): t["logprob"] for t in e.get("top_logprobs") or []}
                         for e in entries],
    }


def job_error(view: dict[str, Any]) -> OpenAIError:
    """Why a choice's job did not succeed, as the HTTP error its request gets."""
    error = view.get("error") or {}
    kind, message = str(error.get("type", view.get("status"))), str(error.get("message", view.get("status")))
    if kind in _INVALID_ERRORS:
        return OpenAIError(400, message, param=error.get("field"), code=kind)
    if view.get("status") == "cancelled":
        return OpenAIError(409, f"the request's job was cancelled: {message}", code="cancelled")
    if view.get("status") == "expired":
        return OpenAIError(408, message, code="expired")
    return OpenAIError(500, f"generation failed: {message}", code=kind)
