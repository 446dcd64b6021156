"""`carpool bench`: workloads are seeded and shaped as documented; `--quick` writes a complete report."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.checks import step_count_ceiling
from bench.cli import build_parser, config_from_args
from bench.config import BenchConfig
from bench.records import percentile
from bench.plan import build_workloads
from bench.workloads import SKEWED_OUTPUT_LENS, BenchRequest, Workload, mixed_lanes, poisson_arrivals, shared_prefix, sharegpt_like, skewed
from gateway.cli.main import main as carpool_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_workloads_are_seeded_and_shaped() -> None:
    a, b = skewed(40, seed=3), skewed(40, seed=3)
    assert a == b and a != skewed(40, seed=4)
    assert {r.max_tokens for r in a.requests} <= set(SKEWED_OUTPUT_LENS)
    assert len({r.max_tokens for r in a.requests}) == 4  # 40 draws cover all four lengths

    share = sharegpt_like(200, seed=1, max_prompt_len=300, max_output_len=100)
    prompt_lens = [len(r.prompt_token_ids) for r in share.requests]
    assert 4 <= min(prompt_lens) and max(prompt_lens) <= 300
    assert all(4 <= r.max_tokens <= 100 for r in share.requests)
    assert 40 <= percentile(prompt_lens, 50) <= 90  # log-normal around a median of 64

    prefixed = shared_prefix(5, prefix_len=100, suffix_len=8)
    heads = {tuple(r.prompt_token_ids[:100]) for r in prefixed.requests}
    tails = {tuple(r.prompt_token_ids[100:]) for r in prefixed.requests}
    assert len(heads) == 1 and len(tails) == 5

    mixed, alone = mixed_lanes(6, 10, 4.0, seed=2), mixed_lanes(6, 10, 4.0, seed=2, with_batch=False)
    assert [r.lane for r in alone.requests] == ["interactive"] * 6
    assert sum(r.lane == "batch" for r in mixed.requests) == 10
    assert [r for r in mixed.requests if r.lane == "interactive"] == alone.requests

    timed = poisson_arrivals(a, 10.0, seed=0)
    arrivals = [r.arrival_s for r in timed.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert 2.0 < arrivals[-1] < 8.0  # 39 gaps of mean 0.1 s
    assert [r.max_tokens for r in timed.requests] == [r.max_tokens for r in a.requests]


def test_step_count_ceiling_counts_padded_groups() -> None:
    lens = [50, 500, 100, 200, 50, 50, 100, 100]
    workload = Workload("w", [BenchRequest([1], n) for n in lens])
    ceiling = step_count_ceiling(workload, max_num_seqs=4)
    assert ceiling["static_steps"] == 500 + 100
    assert ceiling["packed_steps"] == 288  # 1150 tokens over 4 busy slots
    assert ceiling["fcfs_steps"] == 500  # filling freed slots in order, the 500 sets the end
    # The skewed workload's ceiling is about 2.4 when groups are large and many.
    many = step_count_ceiling(skewed(64 * 60, seed=0), max_num_seqs=64)
    assert 2.25 <= many["ratio"] <= 2.5  # 500 / 212.5 = 2.35 in expectation; this draw gives 2.45


def test_device_and_dtype_flags_are_checked() -> None:
    parser = build_parser({})
    config = config_from_args(parser.parse_args(["--device", "cuda:1", "--dtype", "bfloat16"]))
    assert (config.device, config.dtype) == ("cuda:1", "bfloat16")
    assert config_from_args(parser.parse_args([])).device == "cpu"
    with pytest.raises(ValueError, match="device"):
        BenchConfig(device="tpu")
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float64"])


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)


def test_quick_bench_writes_a_complete_report(tmp_path: Path, tiny_model: Callable[..., str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report"
    # --device and --dtype reach every system, the online worker child included.
    assert carpool_main(["bench", "--quick", "--no-progress", "--output", str(out), "--model", tiny_model(),
                         "--device", "cpu", "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    assert "a --quick run is a smoke test" in printed and "not expected to be met" in printed
    assert all(", as expected of --quick)" in line for line in printed.splitlines() if "NOT met" in line)

    document = json.loads((out / "results.json").read_text())
    assert (document["config"]["device"], document["config"]["dtype"]) == ("cpu", "float32")
    assert document["machine"]["cpu"] and document["machine"]["num_cpus"] >= 1
    config = BenchConfig().quick()
    planned = build_workloads(config)
    runs = {(r["workload"], r["mode"], r["system"], r.get("rate")): r for r in document["runs"]}
    expected_tokens = {"skewed": planned.skewed.num_output_tokens, "sharegpt-like": planned.sharegpt.num_output_tokens}
    for mode in ("static", "dynamic", "continuous"):
        for workload, tokens in expected_tokens.items():
            run = runs[(workload, "offline", mode, None)]
            assert run["num_finished"] == run["num_requests"]
            assert run["num_output_tokens"] == tokens
            assert run["output_tokens_per_s"] > 0 and 0 < run["batch_occupancy"] <= 1
            assert run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"] <= run["e2e_ms"]["p99"]
    for peer in ("hf-generate", "hf-generate-batch"):
        if peer in document["peer_errors"]:
            continue  # reported with its error instead
        assert runs[("skewed", "peer", peer, None)]["num_output_tokens"] == expected_tokens["skewed"]
    for rate in ("0.5x", "saturation"):
        online = runs[("sharegpt-like", "online", "continuous", rate)]
        assert online["failed"] == 0 and online["num_finished"] == config.sharegpt_requests
        assert online["num_output_tokens"] == expected_tokens["sharegpt-like"]
    cached = runs[("shared-prefix", "offline", "continuous, prefix cache", None)]
    assert cached["prefix_cache_hit_tokens"] > 0
    assert runs[("shared-prefix", "offline", "continuous, no prefix cache", None)]["prefix_cache_hit_tokens"] == 0
    mixed = runs[("mixed-lanes", "offline", "continuous, priority", None)]
    assert set(mixed["queue_wait_ms"]) == {"interactive", "batch"}
    # Static batching pads: finished members keep their slots.
    assert runs[("skewed", "offline", "static", None)]["padding_share"] > 0
    assert runs[("skewed", "offline", "continuous", None)]["padding_share"] == 0

    skewed_check = document["checks"][0]
    assert skewed_check["whole_run_ratio"] > 0 and skewed_check["step_count_ceiling"] > 1
    for mode in ("static", "continuous"):
        assert runs[("skewed", "offline", mode, None)]["saturated_output_tokens_per_s"] > 0
    assert [c["name"].split(":")[0] for c in document["checks"]] == [
        "skewed", "online at saturation / offline output tokens/s (continuous, sharegpt-like)", "shared-prefix",
        "mixed-lanes", "repetitive", "skewed"]
    for workload in ("repetitive", "skewed"):
        for system in ("continuous, speculation off", "continuous, prompt lookup"):
            assert runs[(workload, "offline", system, None)]["num_finished"] == runs[
                (workload, "offline", system, None)]["num_requests"]
    # The repetitive workload's outputs copy their prompts: prompt lookup proposes and the model accepts.
    looked_up = document["runs"][[i for i, r in enumerate(document["runs"]) if (r["workload"], r["system"]) == (
        "repetitive", "continuous, prompt lookup")][0]]
    assert looked_up["spec_accepted_tokens"] > 0
    assert all(c["measured"] is not None for c in document["checks"])
    # The throughput claims are medians over repeated pairs, each pair measured back to back.
    for check, pairs in zip(document["checks"][:2], (config.skewed_pairs, config.online_pairs)):
        assert len(check["pair_ratios"]) == pairs == 2
        assert check["measured"] == round(statistics.median(check["pair_ratios"]), 3)
    for name in document["plots"]:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert len(document["plots"]) == 3
    markdown = (out / "results.md").read_text()
    assert "| skewed | offline | continuous |" in markdown and "## Claims" in markdown
    assert document["machine"]["cpu"] in markdown


def test_fair_share_workload_writes_both_runs(tmp_path: Path, tiny_model: Callable[..., str]) -> None:
    """`carpool bench --workload fair-share`, small: both runs (two tenants, then one) finish every job."""
    output = tmp_path / "fair"
    assert carpool_main(["bench", "--workload", "fair-share", "--quick", "--fair-share-a", "30",
                         "--fair-share-b", "4", "--model", tiny_model(), "--output", str(output),
                         "--no-progress"]) == 0
    document = json.loads((output / "fair-share.json").read_text())
    fair, fifo = document["runs"]
    assert fair["fair_share"] and not fifo["fair_share"]
    for run in (fair, fifo):
        assert (run["jobs_a"], run["jobs_b"], run["failed"]) == (30, 4, 0)
    markdown = (output / "fair-share.md").read_text()
    assert document["check"]["name"].startswith("fair share") and "fair share (two tenants)" in markdown
    # A --quick run says so, and a missed target is marked as what a quick run is expected to do.
    assert document["quick"] and "A --quick run is a smoke test" in markdown
    assert document["check"]["passed"] or "NOT met, as expected of --quick" in markdown
