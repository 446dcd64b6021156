"""Seeded request sets for the benchmark: what is asked, how long, when and in which lane.

Prompts are token-id lists (the default model's tokenizer is byte level, so
ids 32..126 are printable text); every request sets ``ignore_eos`` so its
output length is exactly the one drawn, whatever a random-weight model emits.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

SKEWED_OUTPUT_LENS = (50, 100, 200, 500)
PRINTABLE_IDS = (32, 127)


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0
    """Offset from the start of the run; 0 for all-at-once (offline) runs."""
    lane: str = "standard"
    priority: int = 0
    temperature: float = 1.0
    """1: sampled (every workload but the repetitive one, which is greedy)."""


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[BenchRequest] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(*PRINTABLE_IDS) for _ in range(length)]


def _scaled(length: int, scale: float) -> int:
    return max(2, round(length * scale))


def skewed(num_requests: int, prompt_len: int = 32, seed: int = 0, output_scale: float = 1.0) -> Workload:
    """Outputs from {50, 100, 200, 500}, each length equally often, in a seeded order: a padded batch runs to its 500.

    The draw is balanced: every length appears ``num_requests // 4`` times
    and the remainder takes distinct lengths at random, then the order is
    shuffled with the seed. Independent draws would let the luck of a seed
    decide how many static groups hold a 500 (and so how much static wastes);
    balanced, the seed only decides the order, which favours neither batching.
    """
    rng = random.Random(seed)
    per_length, remainder = divmod(num_requests, len(SKEWED_OUTPUT_LENS))
    lens = [n for n in SKEWED_OUTPUT_LENS for _ in range(per_length)] + rng.sample(SKEWED_OUTPUT_LENS, remainder)
    rng.shuffle(lens)
    return Workload("skewed", [BenchRequest(_prompt(rng, prompt_len), _scaled(n, output_scale)) for n in lens])


def sharegpt_like(num_requests: int, seed: int = 0, max_prompt_len: int = 512, max_output_len: int = 256) -> Workload:
    """Log-normal prompt and output lengths (medians 64 and 48 tokens), clipped to the given maxima."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = min(max_prompt_len, max(4, round(rng.lognormvariate(math.log(64), 0.8))))
        output_len = min(max_output_len, max(4, round(rng.lognormvariate(math.log(48), 0.8))))
        requests.append(BenchRequest(_prompt(rng, prompt_len), output_len))
    return Workload("sharegpt-like", requests)


def shared_prefix(num_requests: int, prefix_len: int = 768, suffix_len: int = 16, max_tokens: int = 8,
                  gap_s: float = 0.0, seed: int = 0) -> Workload:
    """A long system prompt common to every request plus a short unique question."""
    rng = random.Random(seed)
    system = _prompt(rng, prefix_len)
    return Workload("shared-prefix", [
        BenchRequest(system + _prompt(rng, suffix_len), max_tokens, arrival_s=i * gap_s) for i in range(num_requests)
    ])


def mixed_lanes(num_interactive: int, num_batch: int, interactive_rate: float, seed: int = 0,
                with_batch: bool = True, output_scale: float = 1.0) -> Workload:
    """Short interactive jobs arriving at a Poisson rate over a backlog of longer batch jobs.

    The interactive requests are the same with and without the batch traffic,
    so their TTFT can be compared directly.
    """
    rng = random.Random(seed)
    requests: list[BenchRequest] = []
    t = 0.5 * output_scale  # the batch backlog gets a head start so it owns the engine when interactive work arrives
    for _ in range(num_interactive):
        t += rng.expovariate(interactive_rate)
        requests.append(BenchRequest(_prompt(rng, 24), _scaled(16, output_scale), arrival_s=t, lane="interactive", priority=0))
    batch_rng = random.Random(seed + 1)
    if with_batch:
        requests += [
            BenchRequest(_prompt(batch_rng, 64), _scaled(batch_rng.choice((100, 200)), output_scale), lane="batch",
                         priority=2)
            for _ in range(num_batch)
        ]
    requests.sort(key=lambda r: r.arrival_s)
    return Workload("mixed-lanes" if with_batch else "mixed-lanes (interactive only)", requests)


def poisson_arrivals(workload: Workload, rate_per_s: float, seed: int = 0) -> Workload:
    """The same requests, arriving at a Poisson rate; ``inf`` means all at once."""
    if math.isinf(rate_per_s):
        return Workload(workload.name, [BenchRequest(r.prompt_token_ids, r.max_tokens, 0.0, r.lane, r.priority)
                                        for r in workload.requests])
    rng = random.Random(seed)
    t = 0.0
    timed = []
    for r in workload.requests:
        timed.append(BenchRequest(r.prompt_token_ids, r.max_tokens, t, r.lane, r.priority))
        t += rng.expovariate(rate_per_s)
    return Workload(workload.name, timed)

@dataclass
class Workloads:
    skewed: Workload
    sharegpt: Workload
    shared_prefix: Workload
    mixed_alone: Workload
    mixed_with_batch: Workload
    repetitive: Workload
