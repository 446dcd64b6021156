"""`carpool bench batch-api`: every phase runs on a real stack and the report holds what it measured."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.cli.main import main as carpool_main


def test_batch_api_bench_runs_every_phase_and_writes_its_report(tmp_path: Path, tiny_model: Callable[..., str],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report"
    assert carpool_main(["bench", "batch-api", "--output", str(out), "--model", tiny_model(), "--batch-requests", "40",
                         "--batch-max-tokens", "24", "--interactive", "3", "--interactive-rate", "4", "--pairs", "1"]) == 0
    document = json.loads((out / "batch_api.json").read_text())
    phases = document["phases"]
    assert [p["phase"] for p in phases] == ["alone", "jobs", "batch"]
    alone = phases[0]
    assert alone["interactive_sent"] == alone["interactive_counted"] == 3
    assert 0 < alone["ttft_p50_ms"] <= alone["ttft_p99_ms"]
    # The first chunk comes with the first token; the first text with it or after it.
    assert alone["ttft_p50_ms"] <= alone["first_text_p50_ms"] <= alone["first_text_p99_ms"]
    assert alone["queued_p50_ms"] is not None and alone["engine_ttft_p50_ms"] is not None
    for phase in phases[1:]:  # every request of the batch, whichever way it was sent, ran to its 24 tokens
        assert phase["batch_completed"] == 40 and phase["batch_output_tokens_per_s"] > 0
        # The rate's duration is the report's batch_s before it was rounded to 0.01 s.
        assert 40 * 24 / phase["batch_output_tokens_per_s"] == pytest.approx(phase["batch_s"], abs=0.0051)
    assert {c["name"] for c in document["checks"]} == {
        "interactive TTFT p99 during a Batch API batch / alone",
        "interactive time to first text p99 during a Batch API batch / alone",
        "Batch API throughput / the same requests as plain jobs"}
    [throughput] = [c for c in document["checks"] if c["name"].startswith("Batch API throughput")]
    assert throughput["measured"] > 0
    assert "Batch API throughput / the same requests as plain jobs" in capsys.readouterr().out
