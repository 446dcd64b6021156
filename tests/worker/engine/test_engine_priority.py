"""Priority preemption in the engine: greedy outputs stay token-for-token what transformers gives.

Low-priority requests fill every slot; urgent ones arrive mid-generation and
preempt them. Every output, preempted or not, must equal transformers'
greedy ``generate``, and the preempted ones re-prefill from the prefix cache.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from scheduler import SamplingParams
from tests.harness.model_reference import transformers_greedy
from tests.worker.engine.test_engine_exact import BLOCK_SIZE, assert_same
from worker import Engine

SLOTS = 4
LOW_TOKENS = 24
HIGH_TOKENS = 6


def test_priority_preemption_keeps_greedy_outputs_exact(tiny_model: Callable[..., str]) -> None:
    path = tiny_model("llama")
    rng = random.Random(7)
    vocab = 200
    low_prompts = [[rng.randrange(vocab) for _ in range(2 * BLOCK_SIZE + 3 + i)] for i in range(SLOTS)]
    high_prompts = [[rng.randrange(vocab) for _ in range(5 + i)] for i in range(3)]
    expected_low = transformers_greedy(path, low_prompts, LOW_TOKENS)
    expected_high = transformers_greedy(path, high_prompts, HIGH_TOKENS)

    engine = Engine(model=path, block_size=BLOCK_SIZE, num_blocks=256, max_num_seqs=SLOTS, policy="priority")
    low = SamplingParams(max_tokens=LOW_TOKENS, temperature=0.0, ignore_eos=True)
    high = SamplingParams(max_tokens=HIGH_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(low_prompts):
        engine.add_request(f"low{i}", prompt, low, priority=5)
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    first_token_step: dict[str, int] = {}
    num_steps = 0

    def step() -> None:
        nonlocal num_steps
        num_steps += 1
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
            cached[out.request_id] = out.num_cached_tokens or 0
            if out.token_ids:
                first_token_step.setdefault(out.request_id, num_steps)

    for _ in range(4):
        step()
    added_at = num_steps
    for i, prompt in enumerate(high_prompts):
        engine.add_request(f"high{i}", prompt, high, priority=0)
    while engine.has_unfinished_requests():
        step()

    assert_same(expected_low, [tokens[f"low{i}"] for i in range(SLOTS)])
    assert_same(expected_high, [tokens[f"high{i}"] for i in range(len(high_prompts))])
    stats = engine.stats()
    assert stats.num_priority_preemptions == stats.num_preemptions == len(high_prompts)
    # Each urgent request got its first token in the step right after it was added.
    assert all(first_token_step[f"high{i}"] == added_at + 1 for i in range(len(high_prompts)))
    # The preempted ones re-prefilled their full blocks from the cache: at least their prompts' 2 blocks.
    preempted = [f"low{i}" for i in range(SLOTS) if cached[f"low{i}"] > 0]
    assert len(preempted) == len(high_prompts)
    assert all(cached[rid] >= 2 * BLOCK_SIZE for rid in preempted)
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
