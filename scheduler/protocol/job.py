"""The job message (schema version 1).

A job arrives as a map — the JSON body of ``POST /v1/jobs`` or the msgpack
``job`` field of a lane stream entry — and is validated once into a
``JobSpec``. The job record it is stored in is described in
``scheduler.protocol.job_record``.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import msgpack

from scheduler.params import InvalidParam, SamplingParams
from scheduler.protocol.lanes import DEFAULT_LANE, Lane
from scheduler.protocol.tenants import DEFAULT_TENANT, tenant_of
from scheduler.protocol.webhook_url import WebhookUrlError, parse_webhook_url
from scheduler.protocol.wire_values import decode_failure, first_bad_value, is_text, key_path

SCHEMA_VERSION = 1
MAX_ID_LEN = 128
MAX_MESSAGES = 256
MESSAGE_FIELDS = ("role", "content", "name")
"""What a message may hold; ``name`` (OpenAI's speaker name) is accepted and not used."""
_NOT_A_MAP = "must be a msgpack map or a JSON object"


class JobStatus(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


TERMINAL_STATUSES: frozenset[JobStatus] = frozenset(
    {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED}
)


class WebhookEvent(str, Enum):
    STARTED = "started"
    OUTPUT = "output"
    COMPLETED = "completed"


class JobValidationError(ValueError):
    """A job message field is missing or wrong; ``field`` names it (dotted path)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass
class WebhookSpec:
    url: str
    events: list[WebhookEvent] = field(
        default_factory=lambda: [WebhookEvent.STARTED, WebhookEvent.OUTPUT, WebhookEvent.COMPLETED]
    )

    def wants(self, event: WebhookEvent) -> bool:
        return event in self.events


@dataclass
class JobSpec:
    id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    lane: Lane = DEFAULT_LANE
    priority: int = 0
    deadline: float | None = None
    webhook: WebhookSpec | None = None
    reply_to: str | None = None
    metadata: dict[str, Any] | None = None
    traceparent: str | None = None
    tenant: str = DEFAULT_TENANT
    """Set by the gateway from the API key, by direct producers themselves; a malformed name is the default."""
    v: int = SCHEMA_VERSION

    @classmethod
    def from_wire(cls, data: object, *, default_id: str | None = None) -> JobSpec:
        """Validate a wire map. Raises ``JobValidationError`` naming the first bad field."""
        if not isinstance(data, dict):
            raise JobValidationError("body", "must be a map (JSON object / msgpack map)")
        strange = next((k for k in data if not isinstance(k, (str, bytes))), None)
        if strange is not None:  # a msgpack map keyed by a number, say: named as such, not as an unknown field
            raise JobValidationError("body", f"map keys must be strings, got {type(strange).__name__} {strange!r}")
        data = {_as_str_key(k): v for k, v in data.items()}
        known = {
            "v", "id", "prompt", "prompt_token_ids", "messages", "params", "lane", "priority",
            "deadline", "webhook", "reply_to", "metadata", "traceparent", "tenant",
        }
        unknown = sorted(k for k in data if k not in known)
        if unknown:
            raise JobValidationError(key_path("", unknown[0]), "unknown field")
        bad = first_bad_value(data)
        if bad is not None:
            raise JobValidationError(*bad)
        # A field sent as null is that field left out, everywhere in the message.
        v = SCHEMA_VERSION if data.get("v") is None else data["v"]
        if isinstance(v, bool) or not isinstance(v, int) or v != SCHEMA_VERSION:  # not true, nor 1.0
            raise JobValidationError("v", f"unsupported schema version {v!r}; this server speaks {SCHEMA_VERSION}")
        job_id = default_id if data.get("id") is None else data["id"]
        if job_id is None:
            raise JobValidationError("id", "required")
        if not isinstance(job_id, str) or not job_id or len(job_id) > MAX_ID_LEN:
            raise JobValidationError("id", f"must be a non-empty string of at most {MAX_ID_LEN} characters")
        if any(c.isspace() or not c.isprintable() for c in job_id):
            raise JobValidationError("id", "must not contain whitespace or control characters")

        given = [k for k in ("prompt", "prompt_token_ids", "messages") if data.get(k) is not None]
        if len(given) != 1:
            raise JobValidationError("prompt", "give exactly one of prompt, prompt_token_ids, messages")
        prompt = data.get("prompt")
        if prompt is not None and (not isinstance(prompt, str) or not prompt):
            raise JobValidationError("prompt", "must be a non-empty string")
        token_ids = data.get("prompt_token_ids")
        if token_ids is not None:
            if not isinstance(token_ids, list) or not token_ids:
                raise JobValidationError("prompt_token_ids", "must be a non-empty list of integers")
            # In C rather than item by item: a body may hold a million ids.
            if set(map(type, token_ids)) != {int} or min(token_ids) < 0:
                raise JobValidationError("prompt_token_ids", "every token id must be a non-negative integer")
        messages = _parse_messages(data.get("messages"))

        try:
            params = SamplingParams.from_dict(data.get("params"))
        except InvalidParam as e:
            raise JobValidationError("params" if e.name is None else f"params.{e.name}", e.message) from e
        except (ValueError, TypeError) as e:
            raise JobValidationError("params", str(e)) from e

        try:
            lane = Lane(DEFAULT_LANE.value if data.get("lane") is None else data["lane"])
        except ValueError as e:
            raise JobValidationError("lane", f"must be one of {[l.value for l in Lane]}") from e
        priority = 0 if data.get("priority") is None else data["priority"]
        if isinstance(priority, bool) or not isinstance(priority, int) or not -1000 <= priority <= 1000:
            raise JobValidationError("priority", "must be an integer in [-1000, 1000]")
        deadline = data.get("deadline")
        if deadline is not None:
            if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not math.isfinite(deadline):
                raise JobValidationError("deadline", "must be unix seconds (a number)")
            deadline = float(deadline)
        webhook = parse_webhook(data.get("webhook"))
        reply_to = data.get("reply_to")
        if reply_to is not None and not is_stream_name(reply_to):
            raise JobValidationError("reply_to", "must be a non-empty stream name of at most 256 characters")
        metadata = data.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise JobValidationError("metadata", "must be a map")
        traceparent = data.get("traceparent")
        if traceparent is not None and not isinstance(traceparent, str):
            raise JobValidationError("traceparent", "must be a W3C traceparent string")
        return cls(
            id=job_id, prompt=prompt, prompt_token_ids=token_ids, messages=messages, params=params,
            lane=lane, priority=priority, deadline=deadline, webhook=webhook, reply_to=reply_to,
            metadata=metadata, traceparent=traceparent, tenant=tenant_of(data.get("tenant")),
        )

    def to_wire(self) -> dict[str, Any]:
        """The wire map; optional fields that are unset are left out."""
        out: dict[str, Any] = {"v": self.v, "id": self.id, "params": self.params.to_dict(), "lane": self.lane.value}
        for name in ("prompt", "prompt_token_ids", "messages", "deadline", "reply_to", "metadata", "traceparent"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.priority:
            out["priority"] = self.priority
        if self.tenant != DEFAULT_TENANT:
            out["tenant"] = self.tenant
        if self.webhook is not None:
            out["webhook"] = {"url": self.webhook.url, "events": [e.value for e in self.webhook.events]}
        return out

    def pack(self) -> bytes:
        packed: bytes = msgpack.packb(self.to_wire(), use_bin_type=True)
        return packed

    @classmethod
    def unpack(cls, raw: bytes) -> JobSpec:
        """Decode a lane entry's ``job`` field: a msgpack map, or a JSON object.

        JSON is accepted so producers without a msgpack library (``redis-cli``)
        can XADD jobs; the two cannot be confused, since a msgpack map never
        starts with ``{``, JSON's whitespace or a UTF-8 byte order mark.
        """
        if looks_like_json(raw):
            try:
                data = json.loads(raw)
            except ValueError as e:
                raise JobValidationError("job", f"{_NOT_A_MAP}; it starts with '{{' but is not valid JSON: "
                                                f"{decode_failure(e)}") from e
            except RecursionError as e:
                raise JobValidationError("job", f"{_NOT_A_MAP}; it is JSON nested too deeply") from e
            return cls.from_wire(data)
        try:
            # Text that is no UTF-8 keeps its bad bytes as lone surrogates, which `from_wire` refuses naming the
            # field (a message whose id can be read then gets its failed record, as one in JSON does).
            data = msgpack.unpackb(raw, raw=False, strict_map_key=False, unicode_errors="surrogateescape")
        except Exception as e:  # msgpack raises several unrelated types for garbage
            if (json_kind := _json_kind(raw)) is not None:
                raise JobValidationError("job", f"{_NOT_A_MAP}; it is JSON, but {json_kind}, not an object") from e
            raise JobValidationError("job", f"{_NOT_A_MAP}; it is neither (msgpack: {decode_failure(e)})") from e
        if not isinstance(data, dict):
            json_kind = _json_kind(raw)
            raise JobValidationError("job", f"{_NOT_A_MAP}; it is " + (
                f"a msgpack {type(data).__name__}" if json_kind is None else f"JSON, but {json_kind}, not an object"))
        return cls.from_wire(data)


_JSON_OBJECT_START = re.compile(rb"\A(?:\xef\xbb\xbf)?[ \t\r\n]*\{")
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false",
               type(None): "null"}


def _json_kind(raw: bytes) -> str | None:
    """What JSON value other than an object `raw` holds (``an array``...); None when it is no JSON."""
    try:
        data = json.loads(raw.removeprefix(b"\xef\xbb\xbf"))  # after a UTF-8 byte order mark, as objects are read
    except (ValueError, RecursionError):
        return None
    return _JSON_KINDS.get(type(data))


def looks_like_json(raw: bytes) -> bool:
    """Whether a ``job`` field is meant as a JSON object: ``{`` after JSON's whitespace and a UTF-8 byte order
    mark, if any (bytes no msgpack map starts with)."""
    return _JSON_OBJECT_START.match(raw) is not None


def is_stream_name(value: object) -> bool:
    """Whether a ``reply_to`` value has a stream name's shape (which keys it may name is `Keys.check_reply_to`'s)."""
    return isinstance(value, str) and 0 < len(value) <= 256 and is_text(value)  # a key name Redis can be sent


def new_job_id() -> str:
    return "job_" + secrets.token_hex(12)


def _as_str_key(key: object) -> str:
    if isinstance(key, bytes):
        return key.decode("utf-8", "replace")
    return str(key)


def _parse_messages(value: object) -> list[dict[str, str]] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or len(value) > MAX_MESSAGES:
        raise JobValidationError("messages", f"must be a non-empty list of at most {MAX_MESSAGES} messages")
    out: list[dict[str, str]] = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise JobValidationError(f"messages[{i}]", "must be a map with role and content")
        unknown = sorted(str(k) for k in m if k not in MESSAGE_FIELDS)
        if unknown:
            raise JobValidationError(key_path(f"messages[{i}]", unknown[0]), "unknown field")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant"):
            raise JobValidationError(f"messages[{i}].role", "must be system, user or assistant")
        if not isinstance(content, str):
            raise JobValidationError(f"messages[{i}].content", "must be a string")
        if m.get("name") is not None and not isinstance(m["name"], str):  # null: no name, as leaving it out
            raise JobValidationError(f"messages[{i}].name", "must be a string")
        out.append({"role": role, "content": content})
    return out


def parse_webhook(value: object) -> WebhookSpec | None:
    """A job's ``webhook`` map (None: none asked for); raises ``JobValidationError`` naming what is wrong."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise JobValidationError("webhook", "must be a map with url and events")
    url = value.get("url")
    if not isinstance(url, str) or not url:
        raise JobValidationError("webhook.url", "required string")
    try:
        parse_webhook_url(url)  # the same shape check as the gateway's: a URL no retry could ever send to
    except WebhookUrlError as e:
        raise JobValidationError("webhook.url", str(e).removeprefix("webhook.url: ")) from e
    unknown = sorted(str(k) for k in value if k not in ("url", "events"))
    if unknown:
        raise JobValidationError(f"webhook.{unknown[0]}", "unknown field")
    events = value.get("events")
    if events is None:
        return WebhookSpec(url=url)
    if not isinstance(events, list) or not events:
        raise JobValidationError("webhook.events", "must be a non-empty list")
    try:
        parsed = [WebhookEvent(e) for e in events]
    except ValueError as e:
        raise JobValidationError("webhook.events", f"each must be one of {[x.value for x in WebhookEvent]}") from e
    return WebhookSpec(url=url, events=list(dict.fromkeys(parsed)))
