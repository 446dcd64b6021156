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
