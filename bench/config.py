"""The benchmark's settings: one dataclass, the full comparison by default, ``quick()`` for CI."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from scheduler.scheduler_config import BatchingMode

SWEPT_MODES: tuple[str, ...] = tuple(m.value for m in (BatchingMode.STATIC, BatchingMode.DYNAMIC, BatchingMode.CONTINUOUS))
"""Every batching mode, in the order the benchmark runs and reports them: the padded ones first."""
MODEL_DTYPES = ("float32", "float16", "bfloat16")
QUICK_NOTE = ("a --quick run is a smoke test on a tiny workload: its claims are not expected to be met "
              "(the full run, without --quick, measures them)")


@dataclass(frozen=True)
class BenchConfig:
    model: str | None = None
    """Checkpoint directory; None is the default model."""
    max_num_seqs: int = 8
    seed: int = 0
    skewed_requests: int = 128
    output_scale: float = 1.0
    """Multiplies the skewed output lengths; below 1 only for smoke tests."""
    sharegpt_requests: int = 64
    shared_prefix_requests: int = 12
    shared_prefix_len: int = 768
    mixed_interactive: int = 12
    mixed_batch: int = 40
    mixed_interactive_rate: float = 2.0
    online_rate_fractions: tuple[float, ...] = (0.5, 0.8, math.inf)
    """Arrival rates as fractions of continuous's request rate at saturation online; inf is all at once."""
    online_modes: tuple[str, ...] = SWEPT_MODES
    peers: bool = True
    skewed_pairs: int = 3
    """How often the skewed claim's two sides (static, continuous) are measured; the claim is the median of
    the pairs' ratios. Repeats run back to back on fresh engines."""
    online_pairs: int = 5
    """The same for the online claim (offline, then online at saturation), each repeat on a fresh seed. Its
    runs are short (seconds), so a slow stretch of a shared machine moves one pair a lot: more pairs."""
    repetitive_requests: int = 32
    """Requests of the repetitive workload (bench/repetitive.py), prompt lookup against plain decoding."""
    repetitive_max_tokens: int = 200
    speculative_pairs: int = 3
    """How often each prompt-lookup claim's two sides (off, on) are measured, on `repetitive` and `skewed`."""
    max_wait_ms: float = 50.0
    threads: int = 1
    """torch CPU threads for every system (the engine, the peers, the worker process)."""
    device: str = "cpu"
    """Where every system runs: cpu, cuda or cuda:N (the engine, the peers, the worker process)."""
    dtype: str | None = None
    """Model dtype for every system (float32, float16, bfloat16); None is the checkpoint's."""
    modes: tuple[str, ...] = field(default=SWEPT_MODES)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "threads", "skewed_requests", "sharegpt_requests", "shared_prefix_requests",
                     "mixed_interactive", "mixed_batch", "skewed_pairs", "online_pairs", "repetitive_requests",
                     "repetitive_max_tokens", "speculative_pairs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if not 0 < self.output_scale <= 1:
            raise ValueError(f"output_scale: must be in (0, 1], got {self.output_scale}")
        for mode in (*self.modes, *self.online_modes):
            if mode not in SWEPT_MODES:
                raise ValueError(f"modes: unknown batching mode {mode!r}; modes are {', '.join(SWEPT_MODES)}")
        if "continuous" not in self.modes:
            raise ValueError("modes: continuous is the baseline the others are compared with")
        if self.dtype is not None and self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(MODEL_DTYPES)}, got {self.dtype!r}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device: must be cpu, cuda or cuda:N, got {self.device!r}")
        if not self.online_rate_fractions or any(f <= 0 for f in self.online_rate_fractions):
            raise ValueError("online_rate_fractions: must be positive")

    def quick(self) -> BenchConfig:
        """A few requests with short outputs: checks that every part runs and reports, not speed."""
        return replace(self, max_num_seqs=4, skewed_requests=6, output_scale=0.04, sharegpt_requests=6,
                       shared_prefix_requests=3, shared_prefix_len=128, mixed_interactive=3, mixed_batch=4,
                       mixed_interactive_rate=8.0, online_rate_fractions=(0.5, math.inf),
                       online_modes=("continuous",), max_wait_ms=5.0, skewed_pairs=2, online_pairs=2,
                       repetitive_requests=4, repetitive_max_tokens=24, speculative_pairs=1)
