"""What any value in a job message may be: JSON data that msgpack can carry.

A job arrives as JSON (HTTP, ``redis-cli``) or msgpack (direct producers), and
its values travel on as msgpack (lane entry, job record) and JSON (HTTP
answers, webhook bodies). So every value, however deep, must be one both can
write: text that is valid UTF-8 (no lone surrogate, which JSON's ``\\ud800``
escape allows), integers within 64 bits, finite numbers, string map keys, and
no bytes or msgpack extension types. The walk is iterative and bounded in depth,
so no message can exhaust the stack.
"""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

from msgpack import ExtType

MAX_DEPTH = 32
"""Deepest nesting of maps and lists anywhere in a job message."""

MIN_INT = -(2**63)
MAX_INT = 2**64 - 1


def first_bad_value(data: dict[str, object]) -> tuple[str, str] | None:
    """(field path, what is wrong) for the first value neither JSON nor msgpack can carry, else None."""
    stack: list[tuple[str, object, int]] = [(key_path("", key), value, 1) for key, value in reversed(data.items())]
    while stack:
        path, value, depth = stack.pop()
        if isinstance(value, str):
            if not is_text(value):
                return path, "must be valid UTF-8 text (it holds a lone surrogate)"
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if not MIN_INT <= value <= MAX_INT:
                return path, "integer out of the 64-bit range"
        elif isinstance(value, float):
            if not math.isfinite(value):
                return path, "must be a finite number"
        elif isinstance(value, ExtType):  # a tuple too: named here, not walked into as a list
            return path, f"must be JSON data (text, number, boolean, null, list or map), got a msgpack extension type"
        elif isinstance(value, (dict, list, tuple)):
            if depth >= MAX_DEPTH:
                return path, f"nested deeper than {MAX_DEPTH} levels"
            if isinstance(value, dict):
                for key, item in reversed(list(value.items())):
                    if not isinstance(key, str):
                        return path, f"map keys must be strings, got {type(key).__name__}"
                    if not is_text(key):
                        return path, "map keys must be valid UTF-8 text (one holds a lone surrogate)"
                    stack.append((key_path(path, key), item, depth + 1))
            elif not _is_int_list(value):  # a long list of token ids is checked in C, not item by item
                stack += [(f"{path}[{i}]", item, depth + 1) for i, item in reversed(list(enumerate(value)))]
        else:
            kind = "bytes" if isinstance(value, (bytes, bytearray)) else type(value).__name__
            return path, f"must be JSON data (text, number, boolean, null, list or map), got {kind}"
    return None


def _is_int_list(values: list[object] | tuple[object, ...]) -> bool:
    """Whether `values` holds only integers (no booleans), all in the 64-bit range."""
    return (bool(values) and set(map(type, values)) == {int}
            and MIN_INT <= min(values) and max(values) <= MAX_INT)  # type: ignore[type-var, operator]


def is_text(text: str) -> bool:
    """Whether `text` is valid UTF-8 text: no lone surrogate, which JSON's escapes let a decoded string hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def key_path(path: str, key: str) -> str:
    """`path` extended by map key `key`: ``a.b``, or ``a['odd key']`` (ASCII-escaped) for keys that need it."""
    if key and is_text(key) and key.isprintable() and not any(c in key for c in ".[]"):
        return f"{path}.{key}" if path else key
    return f"{path}[{ascii(key)}]"


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON (numbers are finite)")


def loads_json(text: str | bytes) -> Any:
    """JSON text's value, strictly: Python's parser also takes ``NaN``, ``Infinity`` and ``-Infinity``, which no
    JSON holds; here they raise ValueError, as any other text that is not JSON does."""
    return json.loads(text, parse_constant=_refuse_constant)


def decode_failure(error: Exception) -> str:
    """Why JSON (or msgpack) text could not be read, in the terms of what was sent: Python's own wording for an
    over-long integer ends by advising a setting of the server's process, and a stack overflow says nothing."""
    if isinstance(error, RecursionError) or type(error).__name__ == "StackError":
        return "nested too deeply"
    if isinstance(error, LookupError):  # a Content-Type's charset that names no text encoding
        return f"its Content-Type's charset is no text encoding ({ascii(error.args[0]) if error.args else error})"
    text = str(error)
    if "integer string conversion" in text:
        return "it holds an integer written with too many digits (more than 4300)"
    return text or type(error).__name__
