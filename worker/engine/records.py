"""The engine's counters after a step, as the worker reads them (in this process or across the engine process's socket)."""

from __future__ import annotations

from dataclasses import dataclass


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
