"""Sampler: greedy, truncation, penalties, seeded determinism and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from scheduler.params import SamplingParams
from worker.engine.noise import seeded_exponential_noise
from worker.engine.penalties import apply_penalties
from worker.engine.sampler import SampleRequest, Sampler, filter_logits

VOCAB = 8
# The race kernel is compiled for the GPU where there is one (the GPU check runs this file there), else interpreted.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _request(
    request_id: str = "r",
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    position: int = 0,
    suppress: list[int] | None = None,
    **params: object,
) -> SampleRequest:
    return SampleRequest(request_id, SamplingParams(**params), prompt or [], output or [], position, suppress or [])


def _draw_many(logits: torch.Tensor, num_draws: int, **params: object) -> set[int]:
    sampler = Sampler(logits.shape[-1], seed=0)
    rows = logits.expand(num_draws, -1)
    return {t.token_id for t in sampler.sample(rows, [_request(f"d{i}", **params) for i in range(num_draws)])}


def _assert_drawn_in_proportion(tokens: list[int], probs: torch.Tensor) -> None:
    """Each id's count within five standard deviations of its expectation (a false failure is about 1e-6 likely),
    and no id of probability 0 drawn."""
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = len(tokens) * probs.double()
    spread = (expected * (1 - probs.double())).sqrt()
    assert ((counts - expected).abs() <= 5 * spread).all(), counts
    assert (counts[probs == 0] == 0).all(), counts


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 3.0, 1.5]])  # order: 6, 0, 7, 1, 2, 3, 4, 5


def test_greedy_is_argmax_per_row() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(3))
    tokens = Sampler(50, seed=1).sample(logits, [_request(f"g{i}", temperature=0.0) for i in range(5)])
    assert [t.token_id for t in tokens] == logits.argmax(dim=-1).tolist()
    assert all(t.logprob is None and t.top_logprobs is None for t in tokens)


def test_unrestricted_sampling_reaches_the_whole_support() -> None:
    assert _draw_many(torch.zeros(1, VOCAB), 400, temperature=1.0) == set(range(VOCAB))


def test_top_k_restricts_support() -> None:
    assert _draw_many(LOGITS, 400, temperature=5.0, top_k=3) == {6, 0, 7}


def test_top_p_restricts_support() -> None:
    probs = LOGITS[0].softmax(-1)
    # Mass of the top two (6 and 0) is below 0.8, adding 7 crosses it: exactly three tokens remain.
    assert probs[6] + probs[0] < 0.8 < probs[6] + probs[0] + probs[7]
    assert _draw_many(LOGITS, 400, temperature=1.0, top_p=0.8) == {6, 0, 7}


def test_top_p_zero_keeps_only_the_most_likely_token() -> None:
    assert _draw_many(LOGITS, 200, temperature=1.0, top_p=0.0) == {6}


def test_min_p_restricts_support() -> None:
    # Kept: p >= 0.3 * p_max, i.e. logit >= 3 + ln(0.3) ~= 1.80.
    assert _draw_many(LOGITS, 400, temperature=1.0, min_p=0.3) == {6, 0}


def test_filters_keep_the_top_token_even_when_everything_else_is_cut() -> None:
    filtered = filter_logits(LOGITS, torch.tensor([1]), torch.tensor([0.01]), torch.tensor([1.0]))
    assert torch.isfinite(filtered[0]).tolist() == [i == 6 for i in range(VOCAB)]


def test_suppressed_ids_are_never_drawn() -> None:
    assert 6 not in _draw_many(LOGITS, 200, temperature=1.0, suppress=[6])
    greedy = Sampler(VOCAB).sample(LOGITS, [_request(temperature=0.0, suppress=[6, 0])])
    assert greedy[0].token_id == 7


def test_repetition_penalty_follows_transformers() -> None:
    row = torch.tensor([2.0, -2.0, 1.0, -1.0])
    apply_penalties(row, _request(prompt=[0, 1], output=[1, 1], repetition_penalty=2.0))
    assert row.tolist() == [1.0, -4.0, 1.0, -1.0]


def test_presence_and_frequency_penalties_follow_openai() -> None:
    row = torch.tensor([2.0, -2.0, 1.0, -1.0])
    # Prompt tokens don't count; token 1 appears twice in the output, token 3 once.
    apply_penalties(row, _request(prompt=[0], output=[1, 3, 1], presence_penalty=0.5, frequency_penalty=0.25))
    assert row.tolist() == [2.0, -2.0 - 0.5 - 0.5, 1.0, -1.0 - 0.5 - 0.25]


def test_penalties_apply_inside_sample() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    # Without penalty token 0 wins; with repetition penalty 2 on it (3 -> 1.5), token 1 wins.
    tokens = Sampler(3).sample(logits, [_request(output=[0], temperature=0.0, repetition_penalty=2.0)])
    assert tokens[0].token_id == 1
    assert logits.tolist() == [[3.0, 2.5, 0.0]]  # input untouched


def test_seeded_draw_depends_only_on_seed_position_and_logits() -> None:
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(9))
    target = _request(position=17, temperature=1.0, seed=1234)
    alone = Sampler(300, seed=1).sample(logits, [target])[0].token_id
    others = torch.randn(4, 300)
    batch = torch.cat([others[:2], logits, others[2:]])
    crowd = [
        _request("a", temperature=0.7),
        _request("b", temperature=1.0, seed=5, position=17),
        target,
        _request("c", temperature=0.0),
        _request("d", temperature=1.3, top_k=10),
    ]
    in_batch = Sampler(300, seed=2).sample(batch, crowd)[2].token_id
    assert alone == in_batch
    # Different positions with the same seed give different draws (not a constant).
    sampler = Sampler(300)
    draws = {sampler.sample(logits, [_request(position=p, temperature=1.0, seed=1234)])[0].token_id for p in range(30)}
    assert len(draws) > 5


def test_unfiltered_rows_race_over_the_whole_tempered_distribution() -> None:
    """Rows asking for no top-k/top-p/min-p skip the filter and draw argmax(softmax(l / T) / E)."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    requests = [_request(f"r{p}", position=p, temperature=0.8, seed=40 + p) for p in range(6)]
    drawn = [t.token_id for t in Sampler(300).sample(logits, requests)]
    expected = []
    for row, request in enumerate(requests):
        noise = seeded_exponential_noise(40 + row, request.position, 300)
        expected.append(int(((logits[row] / 0.8).softmax(dim=-1) / noise).argmax()))
    assert drawn == expected


@pytest.mark.parametrize("greedy_beside", [False, True])
def test_unseeded_draws_follow_the_distribution(greedy_beside: bool) -> None:
    """Unseeded rows (drawn by inverse CDF on a CPU) come out in proportion to their probabilities, never a
    token ruled out, and a greedy row beside them stays the argmax."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    num_draws = 4000
    logits = probs.log().expand(num_draws, -1)
    requests = [_request(f"u{i}", temperature=1.0) for i in range(num_draws)]
    if greedy_beside:
        logits = torch.cat([logits, torch.tensor([[0.0, 0.0, 0.0, 5.0, 0.0]])])
        requests.append(_request("greedy", temperature=0.0))
    tokens = [t.token_id for t in Sampler(5, seed=11).sample(logits, requests)]
    if greedy_beside:
        assert tokens.pop() == 3
    _assert_drawn_in_proportion(tokens, probs)


@pytest.mark.parametrize("race_kernel", [False, True], ids=["torch-ops", "race-kernel"])
def test_unseeded_draws_follow_the_sampler_seed_and_not_the_global_rng(race_kernel: bool) -> None:
    """Through torch's ops or the one-kernel race (a GPU's default; here under Triton's interpreter)."""
    logits = torch.zeros(20, 1000, device=DEVICE)
    requests = [_request(f"u{i}", temperature=1.0) for i in range(20)]

    def drawn(seed: int) -> list[int]:
        sampler = Sampler(1000, device=DEVICE, seed=seed, race_kernel=race_kernel)
        return [t.token_id for t in sampler.sample(logits, requests)]

    torch.manual_seed(0)
    first = drawn(7)
    torch.manual_seed(99)
    assert drawn(7) == first
    state = torch.get_rng_state()
    sampler = Sampler(1000, device=DEVICE, seed=8, race_kernel=race_kernel)
    other = [t.token_id for t in sampler.sample(logits, requests)]
    assert other != first
    assert [t.token_id for t in sampler.sample(logits, requests)] != other  # each step draws anew
    assert torch.equal(torch.get_rng_state(), state)


def test_logprobs_are_log_softmax_of_the_final_distribution() -> None:
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(4))
    tokens = Sampler(40).sample(
        logits,
        [_request("g", temperature=0.0, logprobs=3), _request("s", temperature=0.5, top_k=2, logprobs=4, seed=3)],
    )
    greedy_lp = logits[0].log_softmax(-1)
    assert tokens[0].logprob == pytest.approx(greedy_lp.max().item(), abs=1e-6)
    top = greedy_lp.topk(3)
    assert tokens[0].top_logprobs == pytest.approx(dict(zip(top.indices.tolist(), top.values.tolist())), abs=1e-6)
    # Sampled row: temperature 0.5, then only the top two tokens remain.
    scaled = logits[1] / 0.5
    kept = scaled.topk(2).indices.tolist()
    assert tokens[1].token_id in kept
    two = scaled[kept].log_softmax(-1)
    expected = dict(zip(kept, two.tolist()))
    assert tokens[1].top_logprobs == pytest.approx(expected, abs=1e-6)  # ruled-out tokens left off
    assert tokens[1].logprob == pytest.approx(expected[tokens[1].token_id], abs=1e-6)
    assert math.fsum(math.exp(v) for v in expected.values()) == pytest.approx(1.0)


def test_logprobs_zero_gives_only_the_sampled_token() -> None:
    token = Sampler(VOCAB).sample(LOGITS, [_request(temperature=0.0, logprobs=0)])[0]
    assert token.token_id == 6
    assert token.logprob == pytest.approx(LOGITS[0].log_softmax(-1)[6].item())
    assert token.top_logprobs == {}


def test_temperature_sharpens_the_distribution() -> None:
    logits = torch.tensor([[1.0, 0.0]])
    counts_hot = sum(t == 0 for t in _draw_list(logits, 600, temperature=2.0))
    counts_cold = sum(t == 0 for t in _draw_list(logits, 600, temperature=0.25))
    # p(token 0) = sigmoid(1/T): ~0.62 at T=2, ~0.98 at T=0.25.
    assert 0.52 * 600 < counts_hot < 0.72 * 600
    assert counts_cold > 0.94 * 600


def _draw_list(logits: torch.Tensor, num_draws: int, **params: object) -> list[int]:
    sampler = Sampler(logits.shape[-1], seed=11)
    rows = logits.expand(num_draws, -1)
    return [t.token_id for t in sampler.sample(rows, [_request(f"d{i}", **params) for i in range(num_draws)])]


@pytest.mark.parametrize("extra", [{}, {"seed": 5}, {"top_p": 0.9}, {"top_k": 3, "seed": 1}])
def test_a_temperature_too_small_for_the_float_range_draws_the_argmax(extra: dict[str, object]) -> None:
    """logit / 1e-40 passes the float range; the draw is then the limit of a falling temperature, the argmax
    (the draw by inverse CDF, the race, and both behind a filter), with the whole probability on it."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(8)) * 4
    requests = [_request(f"t{i}", position=i, temperature=1e-40, logprobs=2, **extra) for i in range(6)]
    tokens = Sampler(300, seed=3).sample(logits, requests)
    assert [t.token_id for t in tokens] == logits.argmax(dim=-1).tolist()
    assert all(t.logprob == 0.0 and t.top_logprobs == {t.token_id: 0.0} for t in tokens)


def test_a_tiny_temperature_keeps_tied_top_tokens_and_only_those() -> None:
    logits = torch.tensor([[1.0, 3.0, -2.0, 3.0, 0.5]])
    assert _draw_many(logits, 200, temperature=1e-40) == {1, 3}


def test_the_race_kernel_draws_the_distribution_and_keeps_a_greedy_row_the_argmax() -> None:
    """With the one-kernel race (a GPU's default; here under Triton's interpreter), unseeded rows come out in
    proportion to their probabilities at their temperature, never a token ruled out, and a greedy row beside
    them stays the argmax."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    num_draws = 300
    greedy_row = torch.tensor([[0.0, 0.0, 0.0, 5.0, 0.0]])
    logits = torch.cat([(probs.log() * 0.5).expand(num_draws, -1), greedy_row]).to(DEVICE)
    requests = [_request(f"u{i}", temperature=0.5) for i in range(num_draws)] + [_request("g", temperature=0.0)]
    tokens = [t.token_id for t in Sampler(5, device=DEVICE, seed=11, race_kernel=True).sample(logits, requests)]
    assert tokens.pop() == 3
    _assert_drawn_in_proportion(tokens, probs)


def test_steps_with_seeds_filters_or_logprobs_draw_as_without_the_race_kernel() -> None:
    """A seeded row's token is a function of (seed, position, logits) whichever path a step takes, so the race
    kernel leaves seeded steps to the torch ops; so it does steps that filter or report logprobs."""
    logits = (torch.randn(3, 300, generator=torch.Generator().manual_seed(4)) * 2).to(DEVICE)
    steps = [
        [_request(f"s{i}", position=9, temperature=0.9, seed=i) for i in range(3)],
        [_request(f"p{i}", position=9, temperature=0.9, seed=i, top_p=0.8) for i in range(3)],
        [_request(f"l{i}", position=9, temperature=0.9, seed=i, logprobs=2) for i in range(3)],
    ]
    for requests in steps:
        raced = Sampler(300, device=DEVICE, race_kernel=True).sample(logits, requests)
        assert raced == Sampler(300, device=DEVICE, race_kernel=False).sample(logits, requests)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324])
def test_a_temperature_float32_holds_as_zero_is_greedy(temperature: float) -> None:
    """Positive, but 0 in the sampler's float32 rows: the request is greedy, as temperature 0 is (not drawn
    at temperature 1 behind a divisor of 0 swapped for 1)."""
    assert SamplingParams(temperature=temperature).is_greedy and not SamplingParams(temperature=1e-40).is_greedy
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(8)) * 4
    drawn = [Sampler(300, seed=s).sample(logits, [_request(f"t{i}", position=i, temperature=t, logprobs=2)
                                                 for i in range(6)])
             for s, t in ((3, temperature), (4, 0.0))]
    assert [t.token_id for t in drawn[0]] == [t.token_id for t in drawn[1]] == logits.argmax(dim=-1).tolist()
    assert [t.logprob for t in drawn[0]] == [t.logprob for t in drawn[1]]
