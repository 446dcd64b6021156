"""API keys: made, listed, revoked and looked up in Redis, where only a SHA-256 of each key is kept.

A key is ``cpk_`` + 32 random bytes (URL-safe base64), shown once when it is made. Its hash names a Redis
hash holding the tenant and the limits; every request looks its key up there (no cache), so a revoked key
stops working on every gateway at its next request.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from scheduler.protocol.keys import Keys
from scheduler.protocol.redis_replies import as_bytes, read_hash
from scheduler.protocol.tenants import DEFAULT_TENANT, TenantLimits, is_tenant_name

KEY_PREFIX = "cpk_"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    """A key as stored: never the key itself."""

    id: str
    tenant: str
    created_at: float
    limits: TenantLimits

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "tenant": self.tenant, "created_at": self.created_at, "limits": self.limits.to_json()}


@dataclass(frozen=True)
class Caller:
    """Who a request comes from: its tenant, and the limits of the key it used (none with keys off)."""

    tenant: str
    limits: TenantLimits = TenantLimits()
    is_keyed: bool = False
    """Whether the request came with a key (keys on): it then sees only its tenant's jobs, files and batches."""


OPEN_CALLER = Caller(DEFAULT_TENANT)
"""Every request's caller when keys are off."""


class KeyStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys

    async def create(self, tenant: str, limits: TenantLimits) -> tuple[str, ApiKey]:
        """A new key for `tenant`: (the key, shown only now; its stored record). The tenant's fair-share
        weight becomes the one in `limits`."""
        if not is_tenant_name(tenant) or tenant == DEFAULT_TENANT:
            raise ValueError(f"tenant: {tenant!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a "
                             f"letter or digit, and not {DEFAULT_TENANT!r} (jobs without a tenant)")
        if self._keys.is_own(f"{tenant}:"):
            raise ValueError(f"tenant: {tenant!r} is carpool's key prefix: the tenant's reply_to streams "
                             f"({tenant}:...) would lie among carpool's own keys; pick another name")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        record = ApiKey(id="key_" + secrets.token_hex(8), tenant=tenant, created_at=time.time(), limits=limits)
        hashed = digest(key)
        async with self._redis.pipeline(transaction=True) as pipe:
            fields: dict[str | bytes, str | bytes] = {"id": record.id, "tenant": tenant,
                                                      "created_at": repr(record.created_at)}
            fields.update(limits.to_fields())
            pipe.hset(self._keys.api_key(hashed), mapping=fields)  # type: ignore[arg-type]
            pipe.hset(self._keys.api_keys, record.id, hashed)
            pipe.hset(self._keys.tenant_weights, tenant, limits.weight)
            await pipe.execute()
        return key, record

    async def lookup(self, key: str) -> ApiKey | None:
        """The key's record, or None for a key that was never made or was revoked (or cannot be one: every key
        made is ASCII, and a header's bytes that are no UTF-8 reach here as lone surrogates)."""
        if not key.startswith(KEY_PREFIX) or len(key) > 256 or not key.isascii():
            return None
        return _record(await read_hash(self._redis, self._keys.api_key(digest(key))))

    async def list(self) -> list[ApiKey]:
        ids = await read_hash(self._redis, self._keys.api_keys)
        out = []
        for hashed in ids.values():
            record = _record(await read_hash(self._redis, self._keys.api_key(hashed.decode())))
            if record is not None:
                out.append(record)
        return sorted(out, key=lambda k: (k.tenant, k.created_at))

    async def revoke(self, key_id: str) -> bool:
        """Delete a key by id; False when no such key exists. The tenant's latest key left sets its fair-share
        weight again (the revoked one may have set it); with none left, its jobs still waiting keep the last."""
        hashed = await self._redis.hget(self._keys.api_keys, key_id)
        if hashed is None:
            return False
        record_key = self._keys.api_key(as_bytes(hashed).decode())
        revoked = _record(await read_hash(self._redis, record_key))
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(record_key)
            pipe.hdel(self._keys.api_keys, key_id)
            await pipe.execute()
        if revoked is not None:
            left = [key for key in await self.list() if key.tenant == revoked.tenant]
            if left:
                latest = max(left, key=lambda key: key.created_at)
                await self._redis.hset(self._keys.tenant_weights, revoked.tenant, latest.limits.weight)
        return True


def _record(raw: dict[bytes, bytes]) -> ApiKey | None:
    if not raw:
        return None
    fields = {k.decode(): v.decode() for k, v in raw.items()}
    try:
        return ApiKey(id=fields["id"], tenant=fields["tenant"], created_at=float(fields["created_at"]),
                      limits=TenantLimits.from_fields(fields))
    except (KeyError, ValueError):
        return None  # a record edited by hand into something unreadable grants nothing
