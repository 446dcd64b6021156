"""Typed keys for what the gateway app holds (one object per resource)."""

from __future__ import annotations

import redis.asyncio as aioredis
from aiohttp import web

from gateway.admission import Admission
from gateway.api_keys import KeyStore
from gateway.cancel import Canceller
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.rate_limits import RateLimiter
from gateway.results import EventHub
from scheduler.keys import Keys

CONFIG = web.AppKey("config", GatewayConfig)
KEYS = web.AppKey("keys", Keys)
METRICS = web.AppKey("metrics", GatewayMetrics)
REDIS = web.AppKey("redis", aioredis.Redis)
HUB = web.AppKey("hub", EventHub)
ADMISSION = web.AppKey("admission", Admission)
CANCELLER = web.AppKey("canceller", Canceller)
KEY_STORE = web.AppKey("key_store", KeyStore)
LIMITER = web.AppKey("limiter", RateLimiter)
