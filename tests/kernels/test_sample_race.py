"""The one-kernel exponential race against its reference, and its own noise against the distribution it draws from.

Without a GPU the kernel runs under Triton's interpreter (tests/harness/torch_setup.py sets it).
"""

from __future__ import annotations

import pytest
import torch

from kernels.sample_race import sample_race, sample_race_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The interpreter divides in numpy, which warns where a tiny temperature sends a key to -inf (as intended).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")


def _gumbel(rows: int, vocab: int, seed: int) -> torch.Tensor:
    exponential = torch.empty(rows, vocab).exponential_(generator=torch.Generator().manual_seed(seed))
    return (-exponential.log()).to(DEVICE)


@pytest.mark.parametrize("vocab", [7, 300, 4500])
def test_the_kernel_races_as_the_reference_with_the_same_noise(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(6, vocab, generator=gen) * 4).to(DEVICE)
    logits[1, : vocab // 2] = float("-inf")  # ids ruled out (top-k, suppressed)
    logits[4] = float("-inf")  # a row with nothing left: id 0, as argmax gives
    temperature = torch.tensor([1.0, 0.7, 0.0, 1e-40, 0.0, 2.0], device=DEVICE)
    noise = _gumbel(6, vocab, seed=vocab + 1)
    got = sample_race(logits, temperature, seed=0, noise=noise)
    assert got.tolist() == sample_race_reference(logits, temperature, noise).tolist()
    assert got[2].item() == logits[2].argmax().item()
    assert got[4].item() == 0


def test_a_greedy_row_takes_the_first_of_tied_ids_across_blocks() -> None:
    logits = torch.zeros(2, 4500, device=DEVICE)
    logits[:, [70, 2100, 4400]] = 3.0
    logits[1, 10] = 3.0
    got = sample_race(logits, torch.zeros(2, device=DEVICE), seed=5)
    assert got.tolist() == [70, 10]


def test_a_tiny_temperature_draws_only_among_the_top_ids() -> None:
    logits = torch.zeros(64, 40, device=DEVICE)
    logits[:, [3, 17]] = 9.0
    logits[:, 30] = 8.999
    got = sample_race(logits, torch.full((64,), 1e-40, device=DEVICE), seed=11)
    assert set(got.tolist()) == {3, 17}  # both tied ids drawn, the one just below never


def test_its_own_noise_draws_the_tempered_distribution() -> None:
    rows, vocab, temperature = 400, 4, 0.5  # at temperature 1 instead, the statistic would be about 85
    row = torch.tensor([1.0, 0.5, -0.3, 0.2])
    logits = row.expand(rows, vocab).contiguous().to(DEVICE)
    got = sample_race(logits, torch.full((rows,), temperature, device=DEVICE), seed=1234)
    counts = torch.bincount(got.cpu(), minlength=vocab).double()
    expected = (row / temperature).softmax(-1).double() * rows
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 21.0, (counts.tolist(), expected.tolist())  # 3 degrees of freedom: p < 1e-4 beyond 21


def test_the_same_seed_draws_the_same_tokens_and_another_seed_others() -> None:
    logits = torch.zeros(60, 50, device=DEVICE)
    temperature = torch.ones(60, device=DEVICE)
    first = sample_race(logits, temperature, seed=77)
    assert sample_race(logits, temperature, seed=77).tolist() == first.tolist()
    other = sample_race(logits, temperature, seed=78)
    assert (other != first).sum().item() > 45  # uniform over 50 ids: about 59 of 60 differ
    assert len(set(first.tolist())) > 25  # rows draw apart, not in step: about 35 ids among 60 draws
