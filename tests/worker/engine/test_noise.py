"""The sampler's seeded noise: uniform, uncorrelated, exact, and the same in any batch."""

from __future__ import annotations

import torch

from worker.engine.noise import exponential_noise, neg_log_, seeded_exponential_noise, token_keys, uniform_noise

VOCAB = 4096


def _uniforms(seeds: list[int], positions: list[int], vocab: int = VOCAB) -> torch.Tensor:
    return uniform_noise(torch.tensor(seeds), torch.tensor(positions), token_keys(vocab, "cpu"))


def test_uniforms_lie_strictly_inside_the_unit_interval_on_the_float32_grid() -> None:
    u = _uniforms(list(range(64)), [0] * 32 + list(range(32)))
    assert u.dtype == torch.float32
    assert bool((u > 0).all()) and bool((u < 1).all())
    # u = (2m + 1) / 2^24 exactly: odd multiples of 2^-24.
    scaled = u.double() * 2**24
    assert torch.equal(scaled, scaled.round()) and bool((scaled.long() % 2 == 1).all())


def test_uniforms_are_evenly_spread() -> None:
    u = _uniforms([3] * 16 + [2**62 + 5] * 16, list(range(100, 132)), vocab=8192).flatten()
    n = u.numel()  # 262,144 draws
    assert abs(u.mean().item() - 0.5) < 0.005  # sd of the mean: 0.29 / 512 = 0.00056
    assert abs(u.var().item() - 1 / 12) < 0.002
    # Chi-square over 64 equal bins: 63 degrees of freedom, mean 63, sd ~11; 130 is far in the tail.
    counts = torch.histc(u, bins=64, min=0.0, max=1.0)
    expected = n / 64
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 130, chi_square


def test_neighbouring_seeds_positions_and_tokens_are_uncorrelated() -> None:
    def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
        return float((a * b).sum() / (a.norm() * b.norm()))

    # 32,768 pairs each: the sd of a correlation of independent draws is ~0.0055.
    by_position = _uniforms([7] * 9, list(range(9)), vocab=32768)
    by_seed = _uniforms(list(range(9)), [40] * 9, vocab=32768)
    for block in (by_position, by_seed):
        for i in range(8):
            assert abs(correlation(block[i], block[i + 1])) < 0.03
    assert abs(correlation(by_position[0, :-1], by_position[0, 1:])) < 0.03  # token t vs t + 1
    # Seeds that differ only above bit 32, and a row key in the top lane, still differ.
    high = _uniforms([1, 1 + 2**40], [0, 0])
    assert abs(correlation(high[0], high[1])) < 0.1


def test_noise_is_identical_when_computed_again_and_in_any_batch() -> None:
    seeds, positions = [11, 2**63 - 1, 0, 12345], [0, 5, 2**31, 77]
    block = exponential_noise(torch.tensor(seeds), torch.tensor(positions), token_keys(VOCAB, "cpu"))
    again = exponential_noise(torch.tensor(seeds), torch.tensor(positions), token_keys(VOCAB, "cpu"))
    assert torch.equal(block, again)
    for row, (seed, position) in enumerate(zip(seeds, positions)):
        # Bit for bit, alone as in the block (each element's value does not depend on its neighbours).
        assert torch.equal(seeded_exponential_noise(seed, position, VOCAB), block[row])
        assert torch.equal(seeded_exponential_noise(seed, position, VOCAB + 3)[:VOCAB], block[row])


def test_neg_log_is_accurate_over_every_uniform_the_hash_can_give() -> None:
    u = (torch.arange(2**23, dtype=torch.int64) * 2 + 1).to(torch.float32) * 2.0**-24
    e = neg_log_(u.clone())
    exact = -torch.log(u.double())
    assert bool((e > 0).all())
    # Within 2 units of float32 rounding (2^-24 relative) of the exact value everywhere.
    assert ((e.double() - exact).abs() / exact).max().item() < 2 * 2.0**-24


def test_exponential_noise_has_unit_mean_and_variance() -> None:
    e = exponential_noise(torch.arange(32), torch.arange(32), token_keys(8192, "cpu")).double()
    assert abs(e.mean().item() - 1.0) < 0.01  # sd of the mean: 1 / 512
    assert abs(e.var().item() - 1.0) < 0.03


def test_chunked_noise_equals_the_whole_block() -> None:
    seeds, positions, tokens = torch.arange(7) * 31, torch.arange(7) + 1000, token_keys(VOCAB, "cpu")
    whole = exponential_noise(seeds, positions, tokens)
    for rows_per_chunk in (1, 3, 7, 50):
        assert torch.equal(exponential_noise(seeds, positions, tokens, rows_per_chunk), whole)
