"""Sampled output keeps the target model's distribution with speculative decoding.

A cycling model (tests/worker/engine/test_speculative.py) at temperature 12 with top-k 4 samples from four tokens per
position, the cycle's next token the most likely, so prompt lookup proposes it and the race accepts it
only sometimes. Three tokens per request give 64 outcomes; their exact probabilities come from
transformers' logits of every prefix. A chi-square goodness-of-fit test over 3,000 requests (cells
expected below 5 pooled) must not reject at significance 0.01, with speculation on and off. Seeded
requests give the very same tokens with and without speculation; unseeded ones draw from the sampler's
own generator (seeded here, so the test is deterministic).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.repetitive import make_cycling_model, successors
from scheduler import SamplingParams
from worker import Engine
from worker.engine.sampler import Sampler

NUM_SAMPLES = 3000
NUM_TOKENS = 3
TOP_K = 4
TEMPERATURE = 12.0
SIGNIFICANCE = 0.01
MIN_EXPECTED = 5.0


def prompt() -> list[int]:
    nxt = successors()
    tokens = [65]
    while len(tokens) < 30:
        tokens.append(nxt[tokens[-1]])
    return tokens


def exact_distribution(path: str, prompt_ids: list[int]) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) under temperature and top-k, from transformers' fp32 logits of each prefix."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def next_probs(prefix: tuple[int, ...]) -> dict[int, float]:
        with torch.inference_mode():
            logits = model(torch.tensor([prompt_ids + list(prefix)])).logits[0, -1] / TEMPERATURE
        top = logits.topk(TOP_K)
        probs = top.values.softmax(-1)
        return {int(t): float(p) for t, p in zip(top.indices, probs)}

    dist: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NUM_TOKENS):
        dist = {prefix + (t,): p * q for prefix, p in dist.items() for t, q in next_probs(prefix).items()}
    return dist


def p_value(counts: Counter[tuple[int, ...]], dist: dict[tuple[int, ...], float]) -> float:
    assert set(counts) <= set(dist), "only tokens inside the top-k are ever drawn"
    cells = sorted(dist, key=dist.__getitem__, reverse=True)
    big = [c for c in cells if dist[c] * NUM_SAMPLES >= MIN_EXPECTED]
    small = [c for c in cells if c not in big]
    observed = [counts[c] for c in big] + [sum(counts[c] for c in small)]
    expected = [dist[c] * NUM_SAMPLES for c in big] + [sum(dist[c] for c in small) * NUM_SAMPLES]
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    # The chi-square survival function with len - 1 degrees of freedom: the regularized upper incomplete gamma.
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def sample(path: str, seeded: bool, speculative: str | None, draft_model: str | None = None,
           ) -> tuple[Engine, list[tuple[int, ...]]]:
    engine = Engine(model=path, block_size=8, num_blocks=512, max_num_seqs=64, speculative=speculative,
                    draft_model=draft_model)
    engine.sampler = Sampler(engine.runner.vocab_size, 64, "cpu", seed=1234)
    params = [SamplingParams(max_tokens=NUM_TOKENS, temperature=TEMPERATURE, top_k=TOP_K, ignore_eos=True,
                             seed=i if seeded else None) for i in range(NUM_SAMPLES)]
    return engine, [tuple(c.token_ids) for c in engine.generate([prompt()] * NUM_SAMPLES, params)]


@pytest.fixture(scope="module")
def distribution(cycling_model: str) -> dict[tuple[int, ...], float]:
    dist = exact_distribution(cycling_model, prompt())
    assert abs(sum(dist.values()) - 1) < 1e-5
    return dist


@pytest.mark.parametrize(("speculative", "seeded"), [("ngram", True), ("ngram", False), ("draft", True)],
                         ids=["ngram-seeded", "ngram-unseeded", "draft-seeded"])
def test_speculation_keeps_the_distribution(cycling_model: str, tiny_model: Callable[..., str],
                                            tmp_path_factory: pytest.TempPathFactory,
                                            distribution: dict[tuple[int, ...], float], speculative: str,
                                            seeded: bool) -> None:
    draft = None
    if speculative == "draft":  # a one-layer model of the same cycles: it proposes the likeliest token
        draft = str(make_cycling_model(tiny_model("llama", num_hidden_layers=1),
                                       tmp_path_factory.mktemp("draft") / "m"))
    engine, with_spec = sample(cycling_model, seeded, speculative, draft)
    stats = engine.stats()
    # Proposals were verified at the sampled positions, and both accepted and rejected.
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens, stats
    assert p_value(Counter(with_spec), distribution) > SIGNIFICANCE
    _, without = sample(cycling_model, seeded, None)
    assert p_value(Counter(without), distribution) > SIGNIFICANCE
    if seeded:
        # A seeded token is a pure function of (seed, position, logits): proposals change none of them.
        assert with_spec == without


def test_the_sampled_positions_are_spread(distribution: dict[tuple[int, ...], float]) -> None:
    """The test above is not vacuous: the cycle's token is likely but far from certain at each position."""
    nxt = successors()
    p = prompt()
    on_cycle = (nxt[p[-1]], nxt[nxt[p[-1]]], nxt[nxt[nxt[p[-1]]]])
    assert 0.2 < distribution[on_cycle] < 0.9
    assert sum(1 for c in itertools.islice(sorted(distribution.values(), reverse=True), 20) if c > 0.005) >= 10
