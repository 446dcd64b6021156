"""`bench.host_phases`: the parts of a step add up to it, and the engine's outputs are untouched by the timing."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bench.host_phases import PHASES, host_phases, table_row


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_parts_of_a_step_add_up_to_its_wall_time(tiny_model: Callable[..., str], async_scheduling: bool) -> None:
    result = host_phases(tiny_model("llama"), "cpu", "float32", batch=4, steps=20, async_scheduling=async_scheduling)
    assert result.batch == 4 and set(result.phase_ms) == set(PHASES)
    assert all(result.phase_ms[p] >= 0.0 for p in PHASES if p != "other")
    assert result.phase_ms["wait"] < 0.05 * result.step_ms  # no device to wait for on a CPU: the clock reads only
    assert result.phase_ms["execute"] > 0.0 and result.phase_ms["draw"] > 0.0 and result.phase_ms["postprocess"] > 0.0
    assert sum(result.phase_ms.values()) == pytest.approx(result.step_ms)
    assert table_row(result).startswith("| 4 | ") and table_row(result).count("|") == len(PHASES) + 3
