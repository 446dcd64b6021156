"""The worker process's configuration: every engine setting plus the service settings.

One dataclass, validated once in ``__post_init__`` and passed down. Each field
becomes a ``carpool worker`` flag (``gateway/flags.py``) with a
``CARPOOL_<FLAG>`` environment fallback. Imports no torch.
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any

from scheduler.checkpoint import check_local_checkpoint
from scheduler.keys import DEFAULT_PREFIX, DEFAULT_REPLY_MAXLEN, DEFAULT_RESULT_TTL_S, DEFAULT_DEAD_MAXLEN
from scheduler.lanes import DEFAULT_LANE_WEIGHTS, Lane
from scheduler.tenants import DEFAULT_MAX_TENANT_LABELS

BATCHING_MODES = ("continuous", "dynamic", "static")
POLICIES = ("fcfs", "priority")
# The engine's model implementations (worker.models.ModelImpl; named here so this module imports no torch).
MODEL_IMPLS = ("auto", "carpool", "transformers")
# Weight quantizations (worker.models.quantization.Quantization).
QUANTIZATIONS = ("int8", "fp8")


ENGINE_FLAGS = (
    "model", "device", "block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "batching", "policy",
    "attention_backend", "max_wait_ms", "dtype", "kv_cache_memory_gb", "max_model_len", "enable_prefix_caching",
    "cuda_graphs", "async_scheduling", "model_impl", "quantization", "torch_threads", "engine_process",
    "interactive_reserve",
)
"""The worker's engine settings: `carpool up` takes each of them and hands it to its worker."""

DEFAULT_MODEL_NAME = "carpool-tiny-llama-v1"
"""The built-in model's name (its directory under the model cache too)."""


def default_worker_name() -> str:
    """host-pid-random: unique per process, readable in XINFO CONSUMERS."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass
class WorkerConfig:
    # --- engine -------------------------------------------------------------------
    model: str | None = field(default=None, metadata=_help("local checkpoint directory; default: the built-in tiny Llama model"))
    served_model_name: str | None = field(default=None, metadata=_help(
        "the model's name in the heartbeat, so in the gateway's GET /v1/models; default: --model as given, or "
        "carpool-tiny-llama-v1 for the built-in model"))
    device: str = field(default="cpu", metadata=_help("cpu, cuda or cuda:N"))
    block_size: int = field(default=16, metadata=_help("tokens per KV-cache block"))
    num_blocks: int | None = field(default=None, metadata=_help("KV-cache blocks; default: sized from --kv-cache-memory-gb"))
    max_num_seqs: int = field(default=64, metadata=_help("most sequences in one engine step (and most jobs a worker holds)"))
    max_num_batched_tokens: int = field(default=2048, metadata=_help("token budget of one engine step"))
    batching: str = field(default="continuous", metadata=_help("continuous, dynamic or static"))
    policy: str = field(default="priority", metadata=_help("engine admission order: priority (lane, then job priority) or fcfs"))
    attention_backend: str | None = field(default=None, metadata=_help("torch or triton; default: triton on CUDA, torch on CPU"))
    max_wait_ms: float = field(default=20.0, metadata=_help("dynamic-batching window: how long an idle worker waits for more jobs before its first step"))
    dtype: str | None = field(default=None, metadata=_help("model dtype (float32, float16, bfloat16); default: the checkpoint's"))
    kv_cache_memory_gb: float | None = field(default=None, metadata=_help("memory budget of the KV cache in GiB"))
    max_model_len: int | None = field(default=None, metadata=_help("longest prompt + output; default: the model's"))
    enable_prefix_caching: bool = field(default=True, metadata=_help("reuse KV blocks of shared prompt prefixes"))
    cuda_graphs: bool | None = field(default=None, metadata=_help(
        "replay decode steps as CUDA graphs recorded at start-up; default: on for CUDA with the Triton backend"))
    async_scheduling: bool | None = field(default=None, metadata=_help(
        "schedule and launch the next engine step before turning this one's tokens into outputs (a finishing "
        "request then computes one token more, dropped); default: on for CUDA"))
    model_impl: str = field(default="auto", metadata=_help(
        "auto, carpool or transformers: carpool's own fused model for the Llama family (Llama, Mistral, Qwen2, "
        "Qwen3), transformers' for everything else; auto picks by the checkpoint's architecture"))
    quantization: str | None = field(default=None, metadata=_help(
        "int8 or fp8: hold carpool's models' linear weights (qkv, o, gate_up, down) quantized per output channel, "
        "from an ordinary checkpoint at load; the KV cache and lm_head stay in --dtype; fp8 on CUDA needs "
        "compute capability 8.9+; default: unquantized"))
    torch_threads: int = field(default=0, metadata=_help(
        "torch intra-op threads of this process; 0: one on CPU (fastest for small models on shared cores), torch's default on CUDA"))

    engine_process: bool = field(default=True, metadata=_help(
        "run the engine in a child process, so its steps never wait for the GIL of the worker's Redis I/O; "
        "off: on a thread of the worker process"))

    # --- service ------------------------------------------------------------------
    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata=_help("Redis server holding the lanes"))
    key_prefix: str = field(default=DEFAULT_PREFIX, metadata=_help("prefix of every Redis key"))
    worker_name: str = field(default="", metadata=_help("consumer name in the group; default: host-pid-random"))
    metrics_host: str = field(default="127.0.0.1", metadata=_help(
        "address of the /healthz /readyz /metrics server; loopback unless set (the container image sets 0.0.0.0)"))
    metrics_port: int = field(default=9464, metadata=_help("port of /healthz /readyz /metrics; 0 turns the server off"))
    max_inflight: int | None = field(default=None, metadata=_help("most jobs held at once; default: --max-num-seqs"))
    interactive_reserve: int | None = field(default=None, metadata=_help(
        "with every slot busy, still take up to N more jobs from the interactive lane only, so the engine can "
        "preempt a lower-lane job for them (the one bounded exception to no hoarding; needs --policy priority "
        "and --batching continuous); 0 turns it off; default: max(1, --max-num-seqs / 8)"))
    lane_weights: dict[str, int] = field(
        default_factory=lambda: {lane.value: w for lane, w in DEFAULT_LANE_WEIGHTS.items()},
        metadata=_help("share of reads per lane once interactive work is taken"),
    )
    lease_s: float = field(default=30.0, metadata=_help("a job whose worker stops renewing for this long is reclaimed by another worker"))
    max_deliveries: int = field(default=5, metadata=_help("deliveries after which an entry is dead-lettered and its job failed"))
    checkpoint_tokens: int = field(default=16, metadata=_help("write a running job's tokens to its record every N tokens"))
    checkpoint_interval_s: float = field(default=2.0, metadata=_help("... or at least this often"))
    read_block_ms: int = field(default=200, metadata=_help("how long an idle read waits for new entries"))
    heartbeat_interval_s: float = field(default=2.0, metadata=_help("how often the worker announces itself in the workers hash"))
    shutdown_grace_s: float = field(default=30.0, metadata=_help("on SIGTERM, how long in-flight jobs may run before they are handed back"))
    result_ttl_s: int = field(default=DEFAULT_RESULT_TTL_S, metadata=_help("lifetime of a finished job record"))
    reply_maxlen: int = field(default=DEFAULT_REPLY_MAXLEN, metadata=_help("approximate MAXLEN of reply_to streams"))
    dead_maxlen: int = field(default=DEFAULT_DEAD_MAXLEN, metadata=_help("approximate MAXLEN of the dead-letter stream"))
    webhook_output_interval_s: float = field(default=0.5, metadata=_help("least time between two `output` webhook deliveries of one job"))
    max_tenant_labels: int = field(default=DEFAULT_MAX_TENANT_LABELS, metadata=_help(
        "distinct tenants named in the carpool_tenant_* metrics; later ones are counted as `other`"))
    log_level: str = field(default="INFO", metadata=_help("DEBUG, INFO, WARNING or ERROR"))

    def __post_init__(self) -> None:
        if not self.worker_name:
            self.worker_name = default_worker_name()
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching: must be one of {BATCHING_MODES}, got {self.batching!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {POLICIES}, got {self.policy!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl: must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: must be one of {QUANTIZATIONS} or unset, got {self.quantization!r}")
        if self.max_tenant_labels < 0:
            raise ValueError(f"max_tenant_labels: must be >= 0, got {self.max_tenant_labels}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_deliveries", "checkpoint_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads: must be >= 0, got {self.torch_threads}")
        if self.max_inflight is not None and self.max_inflight < 1:
            raise ValueError(f"max_inflight: must be >= 1, got {self.max_inflight}")
        if self.interactive_reserve is not None and self.interactive_reserve < 0:
            raise ValueError(f"interactive_reserve: must be >= 0, got {self.interactive_reserve}")
        for name in ("lease_s", "checkpoint_interval_s", "heartbeat_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("max_wait_ms", "shutdown_grace_s", "webhook_output_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.read_block_ms < 1:
            raise ValueError(f"read_block_ms: must be >= 1, got {self.read_block_ms}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: must be a TCP port or 0, got {self.metrics_port}")
        lanes = {lane.value for lane in Lane}
        for name, weight in self.lane_weights.items():
            if name not in lanes:
                raise ValueError(f"lane_weights: unknown lane {name!r}; lanes are {sorted(lanes)}")
            if weight < 1:
                raise ValueError(f"lane_weights.{name}: must be >= 1, got {weight}")

    @property
    def model_name(self) -> str:
        """The name clients use for this worker's model (OpenAI routes' ``model``)."""
        return self.served_model_name or self.model or DEFAULT_MODEL_NAME

    @property
    def capacity(self) -> int:
        """Most jobs this worker holds at once: no hoarding beyond what the engine can run."""
        return min(self.max_num_seqs, self.max_inflight or self.max_num_seqs)

    @property
    def reserve(self) -> int:
        """Interactive jobs held beyond ``capacity``: only useful where the engine preempts for priority."""
        if self.policy != "priority" or self.batching != "continuous":
            return 0
        if self.interactive_reserve is None:
            return max(1, self.max_num_seqs // 8)
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
        if self.model is not None:
            check_local_checkpoint(self.model)

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``worker.engine.Engine``."""
        return {
            "model": self.model,
            "device": self.device,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "batching": self.batching,
            "policy": self.policy,
            "attention_backend": self.attention_backend,
            "max_wait_ms": self.max_wait_ms,
            "dtype": self.dtype,
            "kv_cache_memory_gb": self.kv_cache_memory_gb,
            "max_model_len": self.max_model_len,
            "enable_prefix_caching": self.enable_prefix_caching,
            "cuda_graphs": self.cuda_graphs,
            "model_impl": self.model_impl,
            "async_scheduling": self.async_scheduling,
            "quantization": self.quantization,
        }
