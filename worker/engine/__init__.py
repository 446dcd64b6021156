"""The engine and everything it owns: the step loop (``engine``), model runner, attention plug-in,
carpool's own models (``models``), sampler, detokenizer, request state, decode graphs, and the engine
process with the records that cross its boundary (``process``, ``tick``, ``records``).

``from worker.engine import Engine`` loads torch lazily, like ``from worker import Engine``, so the
torch-free modules here (``records``, ``tick``) stay cheap to import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.engine.engine import Completion, Engine, EngineConfig, EngineStats, RequestOutput

__all__ = ["Completion", "Engine", "EngineConfig", "EngineStats", "RequestOutput"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from worker.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'worker.engine' has no attribute {name!r}")
