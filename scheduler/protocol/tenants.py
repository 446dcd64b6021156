"""Tenants: who a job belongs to, the limits a key sets, and how a lane's slots are shared between tenants.

A tenant is a name. The gateway takes it from the API key; a producer that
XADDs straight into Redis puts it in the job message's ``tenant`` field (Redis
access is the trust boundary: whoever can write the streams can name any
tenant). A missing or malformed name is the default tenant, whose jobs wait in
the lane stream itself; every other tenant has one stream per lane.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

DEFAULT_TENANT = "default"
"""Jobs without a (valid) tenant. Reserved: no key can be made for it."""

OTHER_TENANT_LABEL = "_other"
"""Metric label of every tenant past the cap on distinct tenant labels."""

DEFAULT_MAX_TENANT_LABELS = 100
"""Distinct tenants a process names in its metrics before it counts the rest as ``_other``."""

MAX_TENANT_LEN = 64
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

DEFAULT_WEIGHT = 1
MAX_WEIGHT = 1000
MAX_LIMIT = 10**12
"""The largest rpm, tpm or max_queued a key may set: counts stay exact in Redis (64-bit integers, and Lua's
doubles) however much one request reserves on top of a window's worth."""
_DIGITS = re.compile(r"[0-9]+")


def is_tenant_name(value: object) -> bool:
    """1..64 characters of letters, digits, ``.``, ``_`` and ``-``, starting with a letter or digit."""
    return isinstance(value, str) and len(value) <= MAX_TENANT_LEN and _NAME.fullmatch(value) is not None


def tenant_of(value: object) -> str:
    """The tenant a message field names: itself when it is a valid name, else the default tenant."""
    return value if isinstance(value, str) and is_tenant_name(value) else DEFAULT_TENANT


def named_tenants(members: Iterable[bytes | str]) -> list[str]:
    """A lane's active-tenant set (``Keys.lane_tenants``) as the tenants with streams of their own, sorted: the
    default tenant, whose stream is the lane stream, and names no tenant can have are left out."""
    names = (m.decode(errors="replace") if isinstance(m, bytes) else m for m in members)
    return sorted(t for t in names if t != DEFAULT_TENANT and is_tenant_name(t))


@dataclass(frozen=True)
class TenantLimits:
    """What a key allows its tenant; None means unlimited. Counted per tenant, over a one-minute window."""

    max_queued: int | None = None
    """Jobs of the tenant waiting or running at once."""
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    """Prompt + ``max_tokens`` reserved at submission, settled to the real count when the job ends."""
    weight: int = DEFAULT_WEIGHT
    """The tenant's share inside a lane relative to other active tenants (fair share)."""

    def __post_init__(self) -> None:
        for name in ("max_queued", "requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 1 <= value <= MAX_LIMIT):
                raise ValueError(f"{name}: must be an integer in 1..{MAX_LIMIT} (leave it unset for no limit), "
                                 f"got {value!r}")
        if isinstance(self.weight, bool) or not isinstance(self.weight, int) or not 1 <= self.weight <= MAX_WEIGHT:
            raise ValueError(f"weight: must be an integer in 1..{MAX_WEIGHT}, got {self.weight!r}")

    @property
    def is_rate_limited(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None

    def to_fields(self) -> dict[str, str]:
        """As hash fields (unset limits left out)."""
        out = {"weight": str(self.weight)}
        for name in ("max_queued", "requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None:
                out[name] = str(value)
        return out

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> TenantLimits:
        def num(name: str) -> int | None:
            raw = fields.get(name)
            # A limit stored before limits had a maximum holds as that maximum.
            return None if raw in (None, "") else min(int(raw), MAX_LIMIT)

        return cls(max_queued=num("max_queued"), requests_per_minute=num("requests_per_minute"),
                   tokens_per_minute=num("tokens_per_minute"), weight=num("weight") or DEFAULT_WEIGHT)

    def to_json(self) -> dict[str, Any]:
        return {"max_queued": self.max_queued, "requests_per_minute": self.requests_per_minute,
                "tokens_per_minute": self.tokens_per_minute, "weight": self.weight}


_LIMIT_NAMES = {
    "max_queued": "max_queued", "queued": "max_queued",
    "requests_per_minute": "requests_per_minute", "rpm": "requests_per_minute",
    "tokens_per_minute": "tokens_per_minute", "tpm": "tokens_per_minute",
    "weight": "weight",
}


def parse_limits(text: str) -> TenantLimits:
    """``rpm=60,tpm=40000,max_queued=100,weight=2`` (long names work too); raises ValueError naming the fault."""
    values: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, raw = part.partition("=")
        field = _LIMIT_NAMES.get(name.strip())
        if not sep or field is None:
            raise ValueError(f"limits: {part!r} is not NAME=N with NAME one of {', '.join(sorted(_LIMIT_NAMES))}")
        if field in values:
            raise ValueError(f"limits: {field} is given twice")
        if not _DIGITS.fullmatch(raw.strip()):  # int() would also take "1_000", "+5" and other scripts' digits
            raise ValueError(f"limits: {name.strip()} must be an integer written in digits 0-9, got {raw!r}")
        digits = raw.strip().lstrip("0") or "0"
        if len(digits) > len(str(MAX_LIMIT)):  # past every limit (and past int()'s cap on digits)
            raise ValueError(f"limits: {name.strip()} must be at most {MAX_LIMIT}, got a number of {len(digits)} "
                             "digits")
        values[field] = int(digits)
    return TenantLimits(**values)


class TenantLabels:
    """A bounded set of tenant metric labels: the first ``max_tenants`` names seen keep their own label,
    every later one is counted as ``_other``, which no tenant can be named (so a flood of tenants cannot blow up
    the series count)."""

    def __init__(self, max_tenants: int) -> None:
        assert max_tenants >= 0
        self.max_tenants = max_tenants
        self._named: set[str] = set()

    def label(self, tenant: str) -> str:
        if tenant in self._named:
            return tenant
        if len(self._named) < self.max_tenants:
            self._named.add(tenant)
            return tenant
        return OTHER_TENANT_LABEL


class TenantShares:
    """Smooth weighted round-robin over a lane's active tenants, whose set changes from one read to the next.

    Each pick adds every tenant's weight to its credit and serves the one with the most, which then pays the
    total: over any stretch, tenants with work are served in proportion to their weights, interleaved, and
    a tenant that joins starts level with the others instead of being owed the past.
    """

    def __init__(self) -> None:
        self._credit: dict[str, int] = {}

    def keep(self, tenants: set[str]) -> None:
        """Forget the credit of tenants no longer active (one that comes back starts level)."""
        self._credit = {t: c for t, c in self._credit.items() if t in tenants}

    def split(self, slots: int, weights: dict[str, int]) -> dict[str, int]:
        """``slots`` shared out over ``weights``' tenants (each weight >= 1); others keep their credit."""
        for tenant in weights:
            self._credit.setdefault(tenant, 0)
        out = dict.fromkeys(weights, 0)
        if not weights:
            return out
        total = sum(weights.values())
        order = {t: i for i, t in enumerate(sorted(weights))}
        for _ in range(slots):
            for tenant, weight in weights.items():
                self._credit[tenant] += weight
            best = max(weights, key=lambda t: (self._credit[t], -order[t]))
            self._credit[best] -= total
            out[best] += 1
        return out


def estimate_tokens(text: str) -> int:
    """A prompt's tokens before the worker tokenizes it: about four characters a token. The reservation is
    settled to the real count when the job ends, so the estimate only decides the moment of admission."""
    return max(1, math.ceil(len(text) / 4))
