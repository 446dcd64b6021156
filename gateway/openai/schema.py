"""OpenAI request bodies -> carpool job messages, one per choice.

Parameters map one to one onto the job's `params` (`max_tokens` /
`max_completion_tokens`, `temperature`, `top_p`, `stop`, `seed`, the
penalties, `logprobs` / `top_logprobs`), plus carpool's own sampling
parameters as extra body fields the way vLLM takes them. `n` fans out into
`n` jobs; choice `i > 0` gets a seed derived from the request's. Anything
else is refused with a 400 naming the parameter, never silently ignored.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from gateway.errors import invalid, unsupported
from scheduler.params import MAX_SEED, InvalidParam, SamplingParams, json_type
from scheduler.protocol.lanes import Lane
from scheduler.protocol.wire_values import is_text


class Endpoint(str, Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


SERVICE_TIER_LANES = {"priority": Lane.INTERACTIVE, "default": Lane.STANDARD, "auto": Lane.STANDARD,
                      "flex": Lane.BATCH}
MAX_CHOICES = 16
MAX_STOP_SEQUENCES = 4
"""OpenAI's limit on `stop` (carpool's own job API takes more)."""
MAX_TEMPERATURE = 2
"""OpenAI's limit on `temperature` (carpool's own job API takes up to 100)."""
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
"""OpenAI's limits on `metadata`: at most 16 pairs, string keys of at most 64 characters, string values of at
most 512."""
DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's (and vLLM's) default for /v1/completions. A chat completion without max_tokens generates until EOS
or the end of the model's context (the job's ``max_tokens`` is null: the worker gives it the rest of the context
after the templated prompt, as vLLM does)."""

# carpool's own sampling parameters, accepted as extra body fields (as vLLM accepts them).
EXTRA_PARAMS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                "include_stop_str_in_output")
SHARED_PARAMS = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "stop")
_COMMON = {"model", "n", "stream", "stream_options", "max_tokens", "user", "metadata", "service_tier", "lane",
           "priority", *SHARED_PARAMS, *EXTRA_PARAMS}
KNOWN = {
    Endpoint.COMPLETIONS: _COMMON | {"prompt", "logprobs", "echo", "suffix", "best_of", "logit_bias"},
    Endpoint.CHAT: _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "logit_bias", "store",
                              "response_format", "tools", "tool_choice", "parallel_tool_calls", "functions",
                              "function_call"},
}
# Accepted only at their default, which is what carpool does anyway: no tools, so none called, in parallel or not
# (clients send these with every request).
_ONLY_DEFAULT: dict[str, tuple[object, ...]] = {"echo": (False,), "suffix": ("",), "logit_bias": ({},),
                                                "store": (False,), "response_format": ({"type": "text"},),
                                                "tools": ([],), "tool_choice": ("none",),
                                                "parallel_tool_calls": (True, False), "functions": ([],),
                                                "function_call": ("none",)}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class OpenAIRequest:
    endpoint: Endpoint
    model: str
    is_stream: bool
    include_usage: bool
    jobs: list[dict[str, Any]]
    """Job message bodies without ids, one per choice, in choice order."""
    renames: dict[str, str] = field(default_factory=dict)
    """carpool param -> the OpenAI parameter this request gave it as, where they differ (errors name the latter)."""


def parse_request(endpoint: Endpoint, body: object, *, default_lane: Lane, is_batch: bool = False) -> OpenAIRequest:
    if not isinstance(body, dict):
        raise invalid("body", "must be a JSON object")
    given = {k: v for k, v in body.items() if v is not None}
    for name in given:
        if name not in KNOWN[endpoint]:
            raise unsupported(str(name))
        if name in _ONLY_DEFAULT and given[name] not in _ONLY_DEFAULT[name]:
            raise unsupported(name, "is supported only at its default")
    model = given.get("model")
    if model is None:
        raise invalid("model", "required: the name of a model this server serves (GET /v1/models)")
    if not isinstance(model, str) or not model:
        raise invalid("model", f"must be the name of a model this server serves (GET /v1/models), got "
                               f"{json_type(model) if not isinstance(model, str) else 'an empty string'}")
    if not is_text(model):
        raise invalid("model", "must be Unicode text: it holds half of a surrogate pair")
    n = _int(given, "n", 1, low=1, high=MAX_CHOICES)
    if given.get("best_of", n) != n:
        raise unsupported("best_of", "is supported only equal to n")
    is_stream = _bool(given, "stream", False)
    include_usage = _stream_options(given.get("stream_options"), is_stream)
    if is_batch and is_stream:
        raise unsupported("stream", "is not available in a batch")
    if is_batch and n != 1:
        raise unsupported("n", "must be 1 in a batch")

    params, renames = _sampling(endpoint, given)
    if is_stream and params.get("logprobs") is not None:
        raise unsupported("logprobs", "is not available with stream=true")
    try:
        SamplingParams(**params)
    except InvalidParam as e:
        name = e.name or "body"
        raise invalid(renames.get(name, name), e.message) from e
    except (ValueError, TypeError) as e:
        raise invalid("body", str(e)) from e

    job: dict[str, Any] = {"lane": _lane(given, default_lane, is_batch).value}
    if "priority" in given:
        job["priority"] = given["priority"]
    if endpoint is Endpoint.CHAT:
        job["messages"] = _messages(given.get("messages"))
    else:
        job.update(_prompt(given.get("prompt"), is_batch))
    meta: dict[str, Any] = {"model": model}
    if "user" in given:
        meta["user"] = _user(given["user"])
    if "metadata" in given:
        meta["metadata"] = check_metadata(given["metadata"])
    job["metadata"] = meta
    jobs = []
    for i in range(n):
        choice_params = dict(params)
        if params.get("seed") is not None:
            choice_params["seed"] = derive_seed(params["seed"], i)
        jobs.append({**job, "params": choice_params})
    return OpenAIRequest(endpoint, model, is_stream, include_usage, jobs, renames)


def derive_seed(seed: int, choice: int) -> int:
    """Choice 0 keeps the request's seed (so n=1 matches a plain job); the others get independent ones."""
    if choice == 0 or not isinstance(seed, int) or isinstance(seed, bool):
        return seed
    digest = hashlib.blake2b(f"{seed}:{choice}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & MAX_SEED


def _sampling(endpoint: Endpoint, given: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The job's params, and the OpenAI names of params whose carpool names differ."""
    renames: dict[str, str] = {}
    params = {name: given[name] for name in (*SHARED_PARAMS, *EXTRA_PARAMS) if name in given}
    stop = given.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP_SEQUENCES:
        raise invalid("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stop)}")
    temperature = given.get("temperature")
    if (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
            and not 0 <= temperature <= MAX_TEMPERATURE):
        raise invalid("temperature", f"must be in [0, {MAX_TEMPERATURE}], got {temperature}")
    limit_name = "max_completion_tokens" if "max_completion_tokens" in given else "max_tokens"
    if limit_name in given:
        params["max_tokens"] = given[limit_name]
        renames["max_tokens"] = limit_name
    elif endpoint is Endpoint.COMPLETIONS:
        params["max_tokens"] = DEFAULT_COMPLETION_MAX_TOKENS
    else:
        params["max_tokens"] = None
    if endpoint is Endpoint.CHAT:
        if _bool(given, "logprobs", False):
            params["logprobs"] = given.get("top_logprobs", 0)
            renames["logprobs"] = "top_logprobs"
        elif "top_logprobs" in given:
            raise invalid("top_logprobs", "needs logprobs: true")
    elif "logprobs" in given:
        params["logprobs"] = given["logprobs"]
    seed = params.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and -(MAX_SEED + 1) <= seed < 0:
        # OpenAI takes any 64-bit seed, carpool's draws non-negative ones: a negative seed s draws as s + 2^63.
        params["seed"] = seed & MAX_SEED
    return params, renames


def check_metadata(value: object) -> dict[str, str]:
    """OpenAI's `metadata`, on a request or a batch: at most 16 string keys and string values, of bounded length."""
    if not isinstance(value, dict):
        raise invalid("metadata", f"must be an object of at most {MAX_METADATA_PAIRS} string keys and values")
    if len(value) > MAX_METADATA_PAIRS:
        raise invalid("metadata", f"at most {MAX_METADATA_PAIRS} keys, got {len(value)}")
    for key, item in value.items():
        if not is_text(key):
            raise invalid("metadata", f"keys must be valid UTF-8 text, {key[:16]!r} holds a lone surrogate")
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise invalid("metadata", f"keys are at most {MAX_METADATA_KEY_CHARS} characters, {key[:16]!r}… has "
                                      f"{len(key)}")
        if not isinstance(item, str):
            raise invalid(f"metadata.{key}", "must be a string")
        if not is_text(item):
            raise invalid(f"metadata.{key}", "must be valid UTF-8 text (it holds a lone surrogate)")
        if len(item) > MAX_METADATA_VALUE_CHARS:
            raise invalid(f"metadata.{key}", f"must be at most {MAX_METADATA_VALUE_CHARS} characters, got {len(item)}")
    return value


def _user(value: object) -> str:
    if not isinstance(value, str):
        raise invalid("user", "must be a string")
    if not is_text(value):
        raise invalid("user", "must be valid UTF-8 text (it holds a lone surrogate)")
    return value


def _lane(given: dict[str, Any], default: Lane, is_batch: bool) -> Lane:
    if is_batch:
        return Lane.BATCH
    if "lane" in given:
        try:
            return Lane(given["lane"])
        except ValueError as e:
            raise invalid("lane", f"must be one of {[lane.value for lane in Lane]}") from e
    if "service_tier" in given:
        tier = given["service_tier"]
        if not isinstance(tier, str) or tier not in SERVICE_TIER_LANES:
            raise invalid("service_tier", f"must be one of {sorted(SERVICE_TIER_LANES)}")
        return SERVICE_TIER_LANES[tier]
    return default


def _stream_options(value: object, is_stream: bool) -> bool:
    if value is None:
        return False
    if not is_stream:
        raise invalid("stream_options", "only allowed with stream: true")
    if not isinstance(value, dict):
        raise invalid("stream_options", "must be an object")
    for key in value:
        if key not in ("include_usage", "include_obfuscation"):
            raise unsupported(f"stream_options.{key}")
    # Obfuscation pads chunks against size side channels; carpool's chunks are never padded, so either value
    # of `include_obfuscation` is served as false is.
    _bool(value, "include_obfuscation", False, prefix="stream_options.")
    return _bool(value, "include_usage", False, prefix="stream_options.")


def _messages(value: object) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise invalid("messages", "must be a non-empty list of messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(where, "must be an object with role and content")
        # A key set to null is left out, as at the top level: a message the client returned, sent back as its
        # model_dump(), holds refusal, audio, tool_calls... at null.
        message = {k: v for k, v in message.items() if v is not None}
        for key in message:
            if key not in ("role", "content", "name"):
                raise unsupported(f"{where}.{key}")
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise invalid(f"{where}.role", f"must be one of {sorted(_ROLES)}")
        if message.get("name") is not None and not isinstance(message["name"], str):
            raise invalid(f"{where}.name", "must be a string")
        content = message.get("content", "" if _ROLES[role] == "assistant" else None)  # an assistant's may be null
        out.append({"role": _ROLES[role], "content": _content(content, f"{where}.content")})
    return out


def _content(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if not value:
            raise invalid(where, "must be a string or a non-empty list of text parts")
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise unsupported(f"{where}[{j}]", "(only text parts are supported)")
            if not isinstance(part.get("text"), str):
                raise invalid(f"{where}[{j}].text", "required: a text part's text, a string")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(where, "must be a string or a list of text parts")


def _prompt(value: object, is_batch: bool) -> dict[str, Any]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # one prompt in a list
    if isinstance(value, str) and value:
        return {"prompt": value}
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 for t in value):
        return {"prompt_token_ids": value}
    if isinstance(value, list) and len(value) > 1:
        raise unsupported("prompt", "(one prompt per request; put each prompt on a line of its own)" if is_batch
                          else "(one prompt per request; send several requests or a batch)")
    raise invalid("prompt", "must be a non-empty string or a list of token ids")


def _int(given: dict[str, Any], name: str, default: int, *, low: int, high: int) -> int:
    value = given.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise invalid(name, f"must be an integer in [{low}, {high}]")
    return value


def _bool(given: dict[str, Any], name: str, default: bool, prefix: str = "") -> bool:
    value = given.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(prefix + name, "must be a boolean")
    return value
