"""The skewed workload is a balanced draw: every output length equally often, only the order seeded."""

from __future__ import annotations

from collections import Counter

from bench.checks import step_count_ceiling
from bench.workloads import SKEWED_OUTPUT_LENS, skewed


def _lengths(num_requests: int, seed: int) -> list[int]:
    return [r.max_tokens for r in skewed(num_requests, seed=seed).requests]


def test_each_length_appears_equally_often() -> None:
    for seed in range(4):
        assert Counter(_lengths(128, seed)) == {n: 32 for n in SKEWED_OUTPUT_LENS}


def test_the_remainder_takes_distinct_lengths() -> None:
    counts = Counter(_lengths(130, seed=5))
    assert sum(counts.values()) == 130
    assert sorted(counts.values()) == [32, 32, 33, 33]
    assert Counter(_lengths(3, seed=1)).most_common(1)[0][1] == 1


def test_the_seed_decides_only_the_order() -> None:
    a, b = _lengths(64, seed=0), _lengths(64, seed=1)
    assert a != b and sorted(a) == sorted(b)
    assert _lengths(64, seed=0) == a
    # Same total output for every seed, so continuous's packed step count never moves.
    packed = {step_count_ceiling(skewed(128, seed=s), 8)["packed_steps"] for s in range(5)}
    assert packed == {3400}


def test_output_scale_and_prompts() -> None:
    w = skewed(8, prompt_len=12, seed=2, output_scale=0.1)
    assert sorted(r.max_tokens for r in w.requests) == [5, 5, 10, 10, 20, 20, 50, 50]
    assert all(len(r.prompt_token_ids) == 12 and all(32 <= t < 127 for t in r.prompt_token_ids) for r in w.requests)
