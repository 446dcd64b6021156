"""Priority lanes and how a worker shares its reads between them."""

from __future__ import annotations

from enum import Enum


class Lane(str, Enum):
    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BATCH = "batch"


LANES: tuple[Lane, ...] = (Lane.INTERACTIVE, Lane.STANDARD, Lane.BATCH)
"""Every lane, highest priority first."""

DEFAULT_LANE = Lane.STANDARD

DEFAULT_LANE_WEIGHTS: dict[Lane, int] = {Lane.INTERACTIVE: 8, Lane.STANDARD: 3, Lane.BATCH: 1}
"""Relative share of admissions each lane gets when all of them have work."""

LANE_RANK: dict[Lane, int] = {lane: rank for rank, lane in enumerate(LANES)}
"""0 for the most urgent lane; the engine uses it as the coarse priority."""

LANE_PRIORITY_STRIDE = 1_000_000
"""Engine priority = lane rank * stride + job priority (a job's priority is within +-1000), so the lane dominates."""


def engine_priority(lane: Lane, priority: int) -> int:
    """The engine's priority number of a job: lower runs first."""
    return LANE_RANK[lane] * LANE_PRIORITY_STRIDE + priority


def lane_priority_bound(lane: Lane) -> int:
    """An engine priority number above every job of ``lane`` and below every job of the next lane."""
    return LANE_RANK[lane] * LANE_PRIORITY_STRIDE + LANE_PRIORITY_STRIDE // 2
