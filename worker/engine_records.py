"""The engine's records: its settings as given, and its counters after a step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings as given; derived sizes live on the engine itself."""

    model: str
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    batching: str = "continuous"
    policy: str = "fcfs"
    attention_backend: str | None = None
    max_wait_ms: float = 20.0
    dtype: str | None = None
    kv_cache_memory_gb: float | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    cuda_graphs: bool | None = None
    """Replay decode steps as CUDA graphs; None: on for CUDA with the Triton backend."""
    model_impl: str = "auto"
    """carpool's own model (the Llama family), transformers', or the first that fits (auto)."""
    async_scheduling: bool | None = None
    """Prepare the next step on the host while the device runs this one; None: on for CUDA."""
    quantization: str | None = None
    """int8 or fp8 linear weights of carpool's models, per output channel; None: unquantized."""
    speculative: str | None = None
    """Speculative decoding's proposer: ngram (prompt lookup) or draft (a draft model); None: off."""
    num_speculative_tokens: int = 4
    """Most tokens proposed per sequence and step."""
    draft_model: str | None = None
    """The draft model's checkpoint directory (with speculative="draft")."""

    def __post_init__(self) -> None:
        if self.speculative not in (None, "ngram", "draft"):
            raise ValueError(f"speculative: must be one of ngram, draft or unset, got {self.speculative!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens: must be >= 1, got {self.num_speculative_tokens}")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("draft_model: give a draft model exactly when speculative is draft")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks: must be positive, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len: must be positive, got {self.max_model_len}")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_kv_blocks_used: int
    kv_usage: float
    """Share of KV blocks in use, 0..1 (evictable cached blocks count as free)."""
    num_preemptions: int
    """Every preemption by recompute, for lack of KV blocks or for priority."""
    num_priority_preemptions: int
    """Preemptions made only to admit a more urgent waiting request (``priority`` policy)."""
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_steps: int
    last_step_num_tokens: int
    last_step_num_seqs: int
    last_step_s: float
    spec_proposer: str | None = None
    """The speculative proposer (ngram, draft), None when speculation is off."""
    spec_num_drafts: int = 0
    """Proposals verified since start (one per speculating sequence and step)."""
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
