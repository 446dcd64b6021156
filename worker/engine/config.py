"""The engine's settings: one dataclass, validated once, handed to ``Engine``. Imports no torch.

``WorkerConfig`` holds one (each field is also a ``carpool worker`` flag, through
``scheduler.runtime.flags``), and ``Engine(EngineConfig(...))`` or
``Engine(model=PATH, ...)`` takes the same settings for offline use. Derived
sizes (KV blocks, the context actually served) are the engine's, not written
back here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import StrEnum

from scheduler.runtime.flags import help_text
from scheduler.scheduler_config import (
    DEFAULT_BATCHING,
    DEFAULT_POLICY,
    BatchingMode,
    Policy,
    batching_mode,
    policy,
)

DEFAULT_MODEL_NAME = "carpool-tiny-llama-v1"
"""The built-in model's name (its directory under the model cache too)."""


class ModelImpl(StrEnum):
    AUTO = "auto"
    CARPOOL = "carpool"
    TRANSFORMERS = "transformers"


MODEL_IMPLS = tuple(m.value for m in ModelImpl)


class Quantization(StrEnum):
    INT8 = "int8"
    FP8 = "fp8"


QUANTIZATIONS = tuple(q.value for q in Quantization)

SPECULATIVE_METHODS = ("ngram", "draft")
"""Speculative decoding's proposers (``worker.engine.speculation.Proposer``)."""
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
MAX_NUM_SPECULATIVE_TOKENS = 32
"""More proposed tokens than this per step buy nothing (acceptance falls with each one) and cost memory:
step buffers, and on CUDA the verify graphs, hold ``1 + k`` rows per sequence."""

DTYPES = ("float32", "fp32", "float16", "fp16", "half", "bfloat16", "bf16", "auto")
"""What ``dtype`` may name (``auto``: the checkpoint's, as unset)."""
ATTENTION_BACKENDS = ("torch", "triton")
DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")
_INT_FIELDS = ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
               "num_speculative_tokens")
_BOOL_FIELDS = ("enable_prefix_caching", "cuda_graphs", "cpu_kernels", "async_scheduling", "matmul_tuning")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = field(default=None, metadata=help_text(
        "local checkpoint directory; default: the built-in tiny Llama model"))
    device: str = field(default="cpu", metadata=help_text("cpu, cuda or cuda:N"))
    block_size: int = field(default=16, metadata=help_text("tokens per KV-cache block"))
    num_blocks: int | None = field(default=None, metadata=help_text(
        "KV-cache blocks; default: sized from --kv-cache-memory-gb"))
    max_num_seqs: int = field(default=64, metadata=help_text(
        "most sequences in one engine step (and most jobs a worker holds)"))
    max_num_batched_tokens: int = field(default=2048, metadata=help_text("token budget of one engine step"))
    batching: BatchingMode = field(default=DEFAULT_BATCHING, metadata=help_text("continuous, dynamic or static"))
    policy: Policy = field(default=DEFAULT_POLICY, metadata=help_text(
        "engine admission order: priority (lane, then job priority), fcfs (arrival) or sjf (shortest job first)"))
    attention_backend: str | None = field(default=None, metadata=help_text(
        "torch or triton (CUDA only, unless TRITON_INTERPRET=1); default: triton on CUDA, torch on CPU"))
    max_wait_ms: float = field(default=20.0, metadata=help_text(
        "dynamic-batching window: how long an idle worker waits for more jobs before its first step"))
    dtype: str | None = field(default=None, metadata=help_text(
        "model dtype (float32, float16, bfloat16); default: the checkpoint's"))
    kv_cache_memory_gb: float | None = field(default=None, metadata=help_text(
        "memory budget of the KV cache in GiB (with --draft-model, of both models' caches)"))
    max_model_len: int | None = field(default=None, metadata=help_text("longest prompt + output; default: the model's"))
    enable_prefix_caching: bool = field(default=True, metadata=help_text("reuse KV blocks of shared prompt prefixes"))
    cuda_graphs: bool | None = field(default=None, metadata=help_text(
        "replay decode steps (with --speculative, verify steps too) as CUDA graphs recorded at start-up; default: "
        "on for CUDA with the Triton backend"))
    cpu_kernels: bool | None = field(default=None, metadata=help_text(
        "CPU, fp32: carpool's C kernels (decode attention over the paged cache; for carpool's own models also "
        "add + RMSNorm and RoPE + KV store), compiled at start-up with the system's C compiler ($CC, else cc) "
        "into $XDG_CACHE_HOME/carpool/kernels (~/.cache/...) and checked against the torch path; default: on "
        "where they build and pass, else the torch path, and the start-up log says which"))
    async_scheduling: bool | None = field(default=None, metadata=help_text(
        "schedule and launch the next engine step before this one's tokens reach the host, feeding them to it on "
        "the device (with speculative decoding: after reading them, before turning them into outputs); a "
        "request stopped by a stop token or string then computes one token more, dropped; default: on for CUDA"))
    matmul_tuning: bool | None = field(default=None, metadata=help_text(
        "CUDA, carpool's models in bf16/fp16 or quantized: at start-up, time each kind of weight matrix's "
        "products of 1 to 64 rows (decode steps) through torch's matmul and the launches of carpool's Triton "
        "kernel for small batches, over every layer's matrix, and keep the fastest for each (and whether the MLP's "
        "down projection reads its SiLU-and-multiply in; the start-up log lists where the kernel won), the "
        "choices kept in $XDG_CACHE_HOME/carpool/kernels/matmul-choices "
        "(~/.cache/...) for later starts on the same GPU model; off: torch's matmul for plain weights, the "
        "kernel's default launch for quantized ones; default: on wherever the Triton kernels run"))
    model_impl: ModelImpl = field(default=ModelImpl.AUTO, metadata=help_text(
        "auto, carpool or transformers: carpool's own fused model for the Llama family (Llama, Mistral, Qwen2, "
        "Qwen3), transformers' for everything else; auto picks by the checkpoint's architecture"))
    quantization: Quantization | None = field(default=None, metadata=help_text(
        "int8 or fp8: hold the model's linear weights (carpool's models: qkv, o, gate_up, down; transformers' "
        "models: every nn.Linear) quantized per output channel, from an ordinary checkpoint at load; the KV cache "
        "and lm_head stay in --dtype; a --draft-model's weights are held alike; fp8 on CUDA needs "
        "compute capability 8.9+; default: unquantized"))
    speculative: str | None = field(default=None, metadata=help_text(
        "speculative decoding: ngram (prompt lookup: propose what followed the sequence's last tokens earlier in "
        "its own prompt and output) or draft (a smaller model, --draft-model, proposes); proposals are verified "
        "in the same step as everything else, so outputs are the same tokens; a job opts out with "
        "params.speculative false; default: off"))
    num_speculative_tokens: int = field(default=DEFAULT_NUM_SPECULATIVE_TOKENS, metadata=help_text(
        f"most tokens proposed per sequence and step (1 to {MAX_NUM_SPECULATIVE_TOKENS}, with --speculative); each "
        "sequence's own count adapts to what it gets accepted"))
    draft_model: str | None = field(default=None, metadata=help_text(
        "the draft model's local checkpoint directory (same tokenizer as --model), for --speculative draft"))
    prefill_alone_priority: int | None = field(default=None, metadata={"flag": False})
    """Requests of priority number at most this are prefilled in a step without the less urgent running ones'
    decodes (``SchedulerConfig.prefill_alone_priority``); the worker sets it from ``--interactive-prefill-alone``."""
    lower_prefill_tokens: int | None = field(default=None, metadata={"flag": False})
    """The most prompt tokens the less urgent requests prefill in one step (``SchedulerConfig.lower_prefill_tokens``);
    the worker sets it from ``--lower-lane-prefill-tokens``."""

    def __post_init__(self) -> None:
        # Plain strings naming a mode, policy, implementation or quantization are kept as their enum members.
        object.__setattr__(self, "batching", batching_mode(self.batching))
        object.__setattr__(self, "policy", policy(self.policy))
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl: must be one of {', '.join(MODEL_IMPLS)}, got {self.model_impl!r}")
        object.__setattr__(self, "model_impl", ModelImpl(self.model_impl))
        if self.quantization is not None:
            if self.quantization not in QUANTIZATIONS:
                raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATIONS)} or unset, "
                                 f"got {self.quantization!r}")
            object.__setattr__(self, "quantization", Quantization(self.quantization))
        # From Python, a float or a string here would fail deep in tensor code, and a string flag would be truthy.
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name}: must be an integer, got {value!r}")
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name}: must be true or false, got {value!r}")
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"device: must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPES)} or unset, got {self.dtype!r}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: must be one of {', '.join(ATTENTION_BACKENDS)} or unset, "
                             f"got {self.attention_backend!r}")
        if self.kv_cache_memory_gb is not None and not (
                isinstance(self.kv_cache_memory_gb, (int, float)) and 0 < self.kv_cache_memory_gb < math.inf):
            raise ValueError(f"kv_cache_memory_gb: must be a positive number of GiB, got {self.kv_cache_memory_gb!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks: must be positive, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len: must be positive, got {self.max_model_len}")
        if self.speculative not in (None, *SPECULATIVE_METHODS):
            raise ValueError(f"speculative: must be one of {', '.join(SPECULATIVE_METHODS)} or unset, "
                             f"got {self.speculative!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens: must be within [1, {MAX_NUM_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if self.speculative is None and self.num_speculative_tokens != DEFAULT_NUM_SPECULATIVE_TOKENS:
            raise ValueError("num_speculative_tokens: only with speculative decoding on (speculative ngram or "
                             "draft); without it nothing is proposed")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("draft_model: give a draft model exactly when speculative is draft")
        # Not NaN (which no comparison refuses), nor infinite: a dynamic batch would wait for ever.
        if not (isinstance(self.max_wait_ms, (int, float)) and 0 <= self.max_wait_ms < math.inf):
            raise ValueError(f"max_wait_ms: must be >= 0 and finite, got {self.max_wait_ms}")
