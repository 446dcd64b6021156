"""The carpool worker: the Redis service (stream consumer, intake, job loop, commits, job store,
metrics, config, ``carpool worker``) around the engine, which lives in ``worker.engine``.

``from worker import Engine`` loads torch lazily, so importing light modules
such as ``worker.config`` stays cheap.
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
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
