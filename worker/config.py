"""The worker process's configuration: the engine's settings plus the service settings.

One dataclass, validated once in ``__post_init__`` and passed down; it holds the
engine's ``EngineConfig`` (``worker/engine/config.py``), which the worker hands
to the engine as is. Each field (the engine's included) becomes a ``carpool
worker`` flag (``scheduler/runtime/flags.py``) with a ``CARPOOL_<FLAG>``
environment fallback. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any

from scheduler.protocol.keys import (
    DEFAULT_DEAD_MAXLEN,
    DEFAULT_PREFIX,
    DEFAULT_REPLY_MAXLEN,
    DEFAULT_RESULT_TTL_S,
    check_key_prefix,
)
from scheduler.protocol.lanes import DEFAULT_LANE_WEIGHTS, Lane, lane_priority_bound
from scheduler.protocol.redis_client import REDIS_TIMEOUT_S, check_redis_url
from scheduler.protocol.tenants import DEFAULT_MAX_TENANT_LABELS
from scheduler.runtime.flags import help_text
from scheduler.runtime.model_path import check_local_checkpoint
from scheduler.scheduler_config import BatchingMode, Policy
from scheduler.telemetry.log_format import check_log_level
from worker.engine.config import DEFAULT_MODEL_NAME, EngineConfig

MIN_LEASE_S = 0.1
"""The shortest lease: a worker renews every third of it, and a shorter one than this would leave no room for a
renewal's round trip and a busy event loop, so other workers would take its running jobs as lost."""
CPU_LOWER_LANE_PREFILL_TOKENS = 256
"""``--lower-lane-prefill-tokens`` on CPU: with the built-in model on a 2-core CPU a step of 1,200 prompt tokens
takes ~160 ms, one of 256 about a fifth of that (bench/RESULTS.md)."""


def default_worker_name() -> str:
    """host-pid-random: unique per process, readable in XINFO CONSUMERS."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass
class WorkerConfig:
    # --- engine -------------------------------------------------------------------
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Every engine setting; its fields are flags of their own (``--model``, ``--max-num-seqs``...)."""
    served_model_name: str | None = field(default=None, metadata=help_text(
        "the model's name in the heartbeat, so in the gateway's GET /v1/models; default: --model as given "
        "(less a trailing slash), or carpool-tiny-llama-v1 for the built-in model"))
    torch_threads: int = field(default=0, metadata=help_text(
        "torch intra-op threads of this process; 0: one on CPU (fastest for small models on shared cores), torch's default on CUDA"))

    engine_process: bool = field(default=True, metadata=help_text(
        "run the engine in a child process, so its steps never wait for the GIL of the worker's Redis I/O; "
        "off: on a thread of the worker process"))

    # --- service ------------------------------------------------------------------
    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata=help_text("Redis server holding the lanes"))
    key_prefix: str = field(default=DEFAULT_PREFIX, metadata=help_text("prefix of every Redis key"))
    worker_name: str = field(default="", metadata=help_text("consumer name in the group; default: host-pid-random"))
    metrics_host: str = field(default="127.0.0.1", metadata=help_text(
        "address of the /healthz /readyz /metrics server; loopback unless set (the container image sets 0.0.0.0)"))
    metrics_port: int = field(default=9464, metadata=help_text("port of /healthz /readyz /metrics; 0 turns the server off"))
    max_inflight: int | None = field(default=None, metadata=help_text("most jobs held at once; default: --max-num-seqs"))
    interactive_reserve: int | None = field(default=None, metadata=help_text(
        "with every slot busy, still take up to N more jobs from the interactive lane only, so the engine can "
        "preempt a lower-lane job for them (the one bounded exception to no hoarding; needs --policy priority "
        "and --batching continuous); 0 turns it off; default: max(1, --max-num-seqs / 8)"))
    interactive_prefill_alone: bool = field(default=True, metadata=help_text(
        "prefill a new interactive job in an engine step of its own, without the lower lanes' decodes (they wait "
        "that one step), so its first token does not wait on a full batch's work; needs --policy priority and "
        "--batching continuous"))
    lower_lane_prefill_tokens: int | None = field(default=None, metadata=help_text(
        "with --interactive-prefill-alone: the most prompt tokens the standard and batch lanes' jobs prefill in one "
        "engine step (a prompt longer than what is left continues in the next steps), so a step stays short while "
        "many batch jobs start at once and an interactive job arriving meanwhile waits for a short step; "
        f"0: only --max-num-batched-tokens bounds them; default: {CPU_LOWER_LANE_PREFILL_TOKENS} on CPU, 0 on CUDA"))
    lane_weights: dict[str, int] = field(
        default_factory=lambda: {lane.value: w for lane, w in DEFAULT_LANE_WEIGHTS.items()},
        metadata=help_text("share of reads per lane once interactive work is taken"),
    )
    lease_s: float = field(default=30.0, metadata=help_text("a job whose worker stops renewing for this long is reclaimed by another worker"))
    max_deliveries: int = field(default=5, metadata=help_text("deliveries after which an entry is dead-lettered and its job failed"))
    checkpoint_tokens: int = field(default=16, metadata=help_text("write a running job's tokens to its record every N tokens"))
    checkpoint_interval_s: float = field(default=2.0, metadata=help_text("... or at least this often"))
    read_block_ms: int = field(default=200, metadata=help_text("how long an idle read waits for new entries"))
    redis_timeout_s: float = field(default=REDIS_TIMEOUT_S, metadata=help_text(
        "longest wait for Redis to connect or to answer one command (beyond an idle read's block); past it Redis "
        "counts as unavailable and the worker retries"))
    heartbeat_interval_s: float = field(default=2.0, metadata=help_text("how often the worker announces itself in the workers hash"))
    shutdown_grace_s: float = field(default=30.0, metadata=help_text("on SIGTERM, how long in-flight jobs may run before they are handed back"))
    engine_stall_s: float = field(default=300.0, metadata=help_text(
        "an engine that answers no step for this long is taken as hung: the worker stops (exit 1) and its jobs "
        "go on elsewhere from their checkpoints; above the longest step (a first step's kernel compiles included)"))
    result_ttl_s: int = field(default=DEFAULT_RESULT_TTL_S, metadata=help_text(
        "seconds the record and idempotency key of a job this worker ends live after (keep it equal to the "
        "gateways' --result-ttl-s)"))
    reply_maxlen: int = field(default=DEFAULT_REPLY_MAXLEN, metadata=help_text("approximate MAXLEN of reply_to streams"))
    dead_maxlen: int = field(default=DEFAULT_DEAD_MAXLEN, metadata=help_text("approximate MAXLEN of the dead-letter stream"))
    webhook_output_interval_s: float = field(default=0.5, metadata=help_text("least time between two `output` webhook deliveries of one job"))
    max_tenant_labels: int = field(default=DEFAULT_MAX_TENANT_LABELS, metadata=help_text(
        "distinct tenants named in the carpool_tenant_* metrics; later ones are counted as `other`"))
    log_level: str = field(default="INFO", metadata=help_text("DEBUG, INFO, WARNING or ERROR"))

    def __post_init__(self) -> None:
        if not self.worker_name:
            self.worker_name = default_worker_name()
        check_redis_url(self.redis_url)
        check_key_prefix(self.key_prefix)
        check_log_level(self.log_level)
        if self.max_tenant_labels < 0:
            raise ValueError(f"max_tenant_labels: must be >= 0, got {self.max_tenant_labels}")
        for name in ("max_deliveries", "checkpoint_tokens", "result_ttl_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads: must be >= 0, got {self.torch_threads}")
        if self.max_inflight is not None and self.max_inflight < 1:
            raise ValueError(f"max_inflight: must be >= 1, got {self.max_inflight}")
        if self.interactive_reserve is not None and self.interactive_reserve < 0:
            raise ValueError(f"interactive_reserve: must be >= 0, got {self.interactive_reserve}")
        for name in ("lease_s", "checkpoint_interval_s", "heartbeat_interval_s", "redis_timeout_s", "engine_stall_s"):
            if not 0 < getattr(self, name) < math.inf:  # NaN too
                raise ValueError(f"{name}: must be a finite number of seconds > 0, got {getattr(self, name)}")
        if self.lease_s < MIN_LEASE_S:
            raise ValueError(f"lease_s: must be at least {MIN_LEASE_S} s, got {self.lease_s}")
        for name in ("shutdown_grace_s", "webhook_output_interval_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.read_block_ms < 1:
            raise ValueError(f"read_block_ms: must be >= 1, got {self.read_block_ms}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: must be a TCP port or 0, got {self.metrics_port}")
        if self.lower_lane_prefill_tokens is not None and self.lower_lane_prefill_tokens < 0:
            raise ValueError(f"lower_lane_prefill_tokens: must be >= 0, got {self.lower_lane_prefill_tokens}")
        lower_prefill = self.lower_lane_prefill_tokens
        if lower_prefill is None:
            lower_prefill = CPU_LOWER_LANE_PREFILL_TOKENS if self.engine.device == "cpu" else 0
        self.engine = dataclasses.replace(
            self.engine,
            prefill_alone_priority=lane_priority_bound(Lane.INTERACTIVE) if self.interactive_prefill_alone else None,
            lower_prefill_tokens=lower_prefill or None)
        lanes = {lane.value for lane in Lane}
        for name, weight in self.lane_weights.items():
            if name not in lanes:
                raise ValueError(f"lane_weights: unknown lane {name!r}; lanes are {sorted(lanes)}")
            if weight < 1:
                raise ValueError(f"lane_weights.{name}: must be >= 1, got {weight}")

    @classmethod
    def of(cls, **settings: Any) -> WorkerConfig:
        """A config from flat settings, the engine's among them, as the flags name them:
        ``WorkerConfig.of(model=PATH, max_num_seqs=8, redis_url=URL)``."""
        engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
        engine = EngineConfig(**{k: v for k, v in settings.items() if k in engine_names})
        return cls(engine=engine, **{k: v for k, v in settings.items() if k not in engine_names})

    @property
    def model_name(self) -> str:
        """The name clients use for this worker's model (OpenAI routes' ``model``)."""
        # `--model dir/` is `dir`: a path's trailing slash (a shell's completion adds one) is no part of a name.
        return self.served_model_name or (self.engine.model or "").rstrip("/") or self.engine.model or DEFAULT_MODEL_NAME

    @property
    def capacity(self) -> int:
        """Most jobs this worker holds at once: no hoarding beyond what the engine can run."""
        return min(self.engine.max_num_seqs, self.max_inflight or self.engine.max_num_seqs)

    @property
    def reserve(self) -> int:
        """Interactive jobs held beyond ``capacity``: only useful where the engine preempts for priority."""
        if self.engine.policy is not Policy.PRIORITY or self.engine.batching is not BatchingMode.CONTINUOUS:
            return 0
        if self.interactive_reserve is None:
            return max(1, self.engine.max_num_seqs // 8)
        return self.interactive_reserve

    @property
    def lease_ms(self) -> int:
        return max(1, int(self.lease_s * 1000))

    def weight(self, lane: Lane) -> int:
        return self.lane_weights.get(lane.value, DEFAULT_LANE_WEIGHTS[lane])

    def check_model(self) -> None:
        """Raise ``ValueError`` unless ``model`` is unset or a local checkpoint directory.

        Checked where a process is about to load it, not in ``__post_init__``: a container's
        configuration names a path that exists only where the container runs.
        """
        if self.engine.model is not None:
            check_local_checkpoint(self.engine.model)
        if self.engine.draft_model is not None:
            check_local_checkpoint(self.engine.draft_model, "draft_model")
