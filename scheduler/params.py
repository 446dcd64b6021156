"""Sampling parameters: what a request asks of the sampler and the stop rules.

Field names and meanings follow the `params` map of the job message. Every
check raises `InvalidParam` (a ``ValueError`` whose text is ``"name: message"``)
naming the parameter, so the gateway and the worker can turn a bad request into
a clear error on the job that names the field at fault.
"""

from __future__ import annotations

import math
import struct
from dataclasses import asdict, dataclass, field, fields
from typing import Any

MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 1_000
"""Stop strings a job may give, and characters each: every generated token is checked against them all, on the
worker every job of the batch shares, and a stop's length is text held back from streams until it cannot match."""


NULL_MEANS_ITSELF = frozenset({"max_tokens"})
"""Parameters where null is not the default: ``max_tokens: null`` generates to the end of the context."""

_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", tuple: "array",
               dict: "object", type(None): "null"}


def json_type(value: object) -> str:
    """What `value` is called in JSON (``integer``, ``array``, ``null``...), for messages to clients of a JSON API."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


class InvalidParam(ValueError):
    """A sampling parameter is wrong: `name` is the parameter (None: the params map itself)."""

    def __init__(self, name: str | None, message: str) -> None:
        super().__init__(message if name is None else f"{name}: {message}")
        self.name = name
        self.message = message


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    """Most tokens to generate (the stop token, when one ends the output, counts); None: as many as the model's
    context holds after the prompt (vLLM's meaning), resolved by the engine when it reads the prompt."""
    min_tokens: int = 0
    """Stop tokens, EOS and stop strings are ignored until this many tokens exist."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) keeps every token."""
    min_p: float = 0.0
    seed: int | None = None
    """With a seed each token is a pure function of (seed, position, logits)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; the matched string is trimmed from the text."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end the output (kept in token_ids, not in the text)."""
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top alternatives (0 = sampled only)."""
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    include_stop_str_in_output: bool = False
    speculative: bool = True
    """False opts this request out of speculative decoding on a worker that runs it (same tokens either way)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)):
            raise InvalidParam("stop", f"must be a string or a list of strings, got {json_type(self.stop)}")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            kind = json_type(self.stop_token_ids)
            raise InvalidParam("stop_token_ids", f"must be a list of integers, got {kind}")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParam("min_tokens", f"must not exceed max_tokens ({self.min_tokens} > {self.max_tokens})")
        _check_float("temperature", self.temperature, low=0.0, high=100.0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0)  # 0 keeps only the most likely token, as OpenAI's
        if isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k < 0:
            raise InvalidParam("top_k", f"must be 0 or -1 (no top-k) or a positive count, got {self.top_k}")
        _check_int("top_k", self.top_k, low=0)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=MAX_SEED)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParam("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParam("stop", "must be a string or a list of strings, each non-empty")
            if len(s) > MAX_STOP_LENGTH:
                raise InvalidParam("stop", f"each stop string at most {MAX_STOP_LENGTH} characters, got {len(s)}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                got = t if isinstance(t, int) and not isinstance(t, bool) else json_type(t)
                raise InvalidParam("stop_token_ids", f"must be a list of non-negative integers, got {got}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParam("ignore_eos", "must be a boolean")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise InvalidParam("include_stop_str_in_output", "must be a boolean")
        if not isinstance(self.speculative, bool):
            raise InvalidParam("speculative", "must be a boolean")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0, high=10.0, low_open=True)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)

    @property
    def is_greedy(self) -> bool:
        """Temperature 0, or one so small that the sampler's float32 rows hold it as 0 (1e-300, say)."""
        as_float32: float = struct.unpack("f", struct.pack("f", self.temperature))[0]
        return as_float32 == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SamplingParams:
        """Build from a wire map; unknown keys are an error naming them."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise InvalidParam(None, "must be a map")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise InvalidParam(unknown[0], "unknown sampling parameter")
        # null is the default, as leaving the parameter out is; but for max_tokens, where it has a meaning of its own.
        return cls(**{k: v for k, v in data.items() if v is not None or k in NULL_MEANS_ITSELF})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_int(name: str, value: object, *, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParam(name, f"must be an integer, got {json_type(value)}")
    if low is not None and value < low:
        raise InvalidParam(name, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise InvalidParam(name, f"must be <= {high}, got {value}")


def _check_float(
    name: str, value: object, *, low: float, high: float, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParam(name, f"must be a number, got {json_type(value)}")
    bound = "(" if low_open else "["
    try:
        v = float(value)
    except OverflowError:  # an integer past float's range (JSON allows thousands of digits)
        raise InvalidParam(name, f"must be in {bound}{low}, {high}], got an integer of {len(str(abs(value)))} "
                                 "digits") from None
    if not math.isfinite(v):
        raise InvalidParam(name, "must be finite")
    if (v <= low if low_open else v < low) or v > high:
        raise InvalidParam(name, f"must be in {bound}{low}, {high}], got {v}")
