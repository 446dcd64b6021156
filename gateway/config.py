"""Gateway configuration: one dataclass, read once at start-up and passed down."""

from __future__ import annotations

import math

from dataclasses import dataclass, field

from gateway.webhooks.config import WebhookConfig
from scheduler.protocol.keys import (
    DEFAULT_FILE_TTL_S,
    DEFAULT_PREFIX,
    DEFAULT_QUEUED_TTL_S,
    DEFAULT_REPLY_MAXLEN,
    DEFAULT_RESULT_TTL_S,
    check_key_prefix,
)
from scheduler.protocol.lanes import LANES, Lane
from scheduler.protocol.redis_client import REDIS_TIMEOUT_S, check_redis_url
from scheduler.protocol.tenants import DEFAULT_MAX_TENANT_LABELS
from scheduler.protocol.worker_heartbeats import DEFAULT_HEARTBEAT_MAX_AGE_S

DEFAULT_MAX_LANE_DEPTH: dict[str, int] = {
    Lane.INTERACTIVE.value: 1_000,
    Lane.STANDARD.value: 10_000,
    Lane.BATCH.value: 100_000,
}


@dataclass
class GatewayConfig:
    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata={"help": "Redis server the lanes and job records live on"})
    host: str = field(default="127.0.0.1", metadata={"help": "address the HTTP API listens on"})
    port: int = field(default=8000, metadata={"help": "port the HTTP API listens on"})
    key_prefix: str = field(default=DEFAULT_PREFIX, metadata={"help": "prefix of every Redis key (several deployments can share one server)"})
    result_ttl_s: int = field(default=DEFAULT_RESULT_TTL_S, metadata={"help": "seconds the record and idempotency key of a job this gateway ends (a cancel while queued) live after; workers apply their own --result-ttl-s to the jobs they end: keep the two equal"})
    queued_ttl_s: int = field(default=DEFAULT_QUEUED_TTL_S, metadata={"help": "seconds a job's record and idempotency key may live from submission while it waits or runs (a backstop for a job that never ends); when it ends they get --result-ttl-s"})
    reply_maxlen: int = field(default=DEFAULT_REPLY_MAXLEN, metadata={"help": "approximate MAXLEN of reply_to streams, for the results of jobs cancelled while queued"})
    max_lane_depth: dict[str, int] = field(
        default_factory=lambda: dict(DEFAULT_MAX_LANE_DEPTH),
        metadata={"help": "jobs a lane may hold before submissions get 429, as lane=N,... (lanes not named keep their default)"},
    )
    retry_after_s: int = field(default=2, metadata={"help": "Retry-After seconds sent with a 429 for a full lane and a 503 while Redis is unavailable"})
    max_model_len: int | None = field(default=None, metadata={"help": (
        "longest prompt + max_tokens a job may ask for (400 beyond it); the smallest context in the workers' heartbeats "
        "caps it (default: that context)")})
    max_wait_s: float = field(default=60.0, metadata={"help": "longest ?wait= a GET may long-poll for"})
    sse_heartbeat_s: float = field(default=15.0, metadata={"help": "seconds between keep-alive comments on an idle event stream"})
    redis_max_connections: int = field(default=100, metadata={"help": "Redis connections the gateway pools; a request waits for a free one"})
    redis_pool_timeout_s: float = field(default=10.0, metadata={"help": "longest wait for a free pooled Redis connection before the request is answered 503"})
    redis_timeout_s: float = field(default=REDIS_TIMEOUT_S, metadata={"help": "longest wait for Redis to connect or to answer one command; past it the request is answered 503"})
    max_body_bytes: int = field(default=4 * 1024 * 1024, metadata={"help": "largest accepted request body"})
    body_timeout_s: float = field(default=30.0, metadata={"help": (
        "a request whose body stops arriving (no byte of it for this many seconds) is answered 408 and its "
        "connection closed; a body that keeps coming, however slowly, is waited for")})
    shutdown_grace_s: float = field(default=5.0, metadata={"help": "seconds open requests get to finish at shutdown"})
    keepalive_timeout_s: float = field(default=75.0, metadata={"help": (
        "seconds an idle keep-alive connection stays open (a client that sends nothing holds no connection longer)")})
    model_heartbeat_max_age_s: float = field(default=DEFAULT_HEARTBEAT_MAX_AGE_S, metadata={"help": (
        "workers heard from within this many seconds are live: they name the models GET /v1/models lists, are "
        "the workers /readyz shows (an older heartbeat, of a worker that died, is removed), and their context "
        "length and vocabulary bound what is admitted")})
    max_batch_requests: int = field(default=50_000, metadata={"help": "most requests (non-blank lines), and most blank lines, in one Batch API input file"})
    max_batch_file_bytes: int = field(default=100 * 1024 * 1024, metadata={"help": "largest Batch API input file; a larger upload is answered 413"})
    file_ttl_s: int = field(default=DEFAULT_FILE_TTL_S, metadata={"help": "seconds uploaded files, batches and their output files are kept"})
    batch_poll_interval_s: float = field(default=0.5, metadata={"help": "seconds between the batch driver's rounds (enqueue, count finished requests)"})
    api_keys: bool = field(default=False, metadata={"help": (
        "require 'Authorization: Bearer <key>' on every /v1 route (keys: carpool keys create); each key's tenant "
        "sees only its own jobs, files and batches, within its key's limits")})
    no_webhooks: bool = field(default=False, metadata={"help": "do not run the webhook dispatcher inside the gateway"})
    max_tenant_labels: int = field(default=DEFAULT_MAX_TENANT_LABELS, metadata={"help": (
        "distinct tenants named in the carpool_tenant_* metrics (the jobs this gateway ends: cancels while "
        "queued); later ones are counted as `other`. Keep it equal to the workers'")})
    webhooks: WebhookConfig = field(default_factory=WebhookConfig, metadata={"flag": False})
    """Secret, allow-list and retry settings; their flags (`--webhook-*`) come from `WebhookConfig`."""

    def __post_init__(self) -> None:
        check_redis_url(self.redis_url)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be within 0..65535, got {self.port}")
        check_key_prefix(self.key_prefix)
        known = {lane.value for lane in LANES}
        depths = dict(DEFAULT_MAX_LANE_DEPTH)
        for lane, depth in self.max_lane_depth.items():
            if lane not in known:
                raise ValueError(f"max_lane_depth: unknown lane {lane!r} (lanes: {', '.join(sorted(known))})")
            if depth < 1:
                raise ValueError(f"max_lane_depth: {lane} must be at least 1, got {depth}")
            depths[lane] = depth
        self.max_lane_depth = depths
        if self.max_tenant_labels < 0:
            raise ValueError(f"max_tenant_labels: must be >= 0, got {self.max_tenant_labels}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be at least 2, got {self.max_model_len}")
        for name in ("result_ttl_s", "queued_ttl_s", "reply_maxlen", "retry_after_s", "max_body_bytes", "redis_max_connections",
                     "max_batch_requests", "max_batch_file_bytes", "file_ttl_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        for name in ("max_wait_s", "sse_heartbeat_s", "shutdown_grace_s", "redis_pool_timeout_s", "redis_timeout_s",
                     "model_heartbeat_max_age_s", "batch_poll_interval_s", "keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if not 0 < self.body_timeout_s < math.inf:
            raise ValueError(f"body_timeout_s: must be a positive number of seconds, got {self.body_timeout_s}")
