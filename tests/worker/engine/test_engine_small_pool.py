"""Random workloads through the real engine on a tiny model with a KV pool that forces preemption: greedy tokens
are those of an engine with a big pool, whatever the arrivals, aborts, stop tokens, chunking, prefix hits,
speculation and async scheduling; and the pool is whole again at the end."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import SamplingParams
from worker import Engine

BLOCK_SIZE = 4
MAX_NEW_TOKENS = 12
# Prompts are slices of these (shared prefixes), then a few tokens of their own. The draft proposer drafts with
# the model itself, so its proposals are accepted up to where they are cut.
BASES = [[5, 6, 7, 8] * 6, [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 2]


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int
    priority: int
    arrive_at: int
    """The step before which it is added."""
    abort_at: int | None
    stop_at: int | None
    """The index of its reference output whose token is its stop token."""


REQUESTS = st.builds(
    lambda base, num_shared, own, max_tokens, priority, arrive_at, abort_at, stop_at: Request(
        (BASES[base][:num_shared] + own)[:20], max_tokens, priority, arrive_at, abort_at, stop_at),
    base=st.integers(0, len(BASES) - 1), num_shared=st.integers(0, 20),
    own=st.lists(st.integers(3, 30), min_size=1, max_size=4),
    max_tokens=st.integers(1, MAX_NEW_TOKENS), priority=st.integers(0, 1), arrive_at=st.integers(0, 6),
    abort_at=st.none() | st.integers(0, 40), stop_at=st.none() | st.integers(0, MAX_NEW_TOKENS - 1))


@dataclass(frozen=True)
class Setup:
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    async_scheduling: bool
    speculative: str | None
    batching: str


SETUPS = st.builds(Setup, num_blocks=st.integers(7, 10), max_num_seqs=st.integers(1, 6),
                   max_num_batched_tokens=st.sampled_from([3, 8, 64]), async_scheduling=st.booleans(),
                   speculative=st.sampled_from([None, "ngram", "draft"]),
                   batching=st.sampled_from(["continuous", "static"]))


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., str]) -> tuple[str, Engine]:
    """The tiny model's path and a big-pool engine for the reference tokens."""
    path = tiny_model("llama")
    return path, Engine(model=path, block_size=BLOCK_SIZE, num_blocks=256, enable_prefix_caching=False)


def test_a_small_pool_gives_the_big_pools_greedy_tokens(model: tuple[str, Engine]) -> None:
    path, big = model
    seen = {"preemptions": 0, "prefix hit tokens": 0, "accepted proposals": 0, "aborts": 0}

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(setup=SETUPS, requests=st.lists(REQUESTS, min_size=1, max_size=8))
    def run(setup: Setup, requests: list[Request]) -> None:
        engine = Engine(model=path, block_size=BLOCK_SIZE, num_blocks=setup.num_blocks,
                        max_num_seqs=setup.max_num_seqs, max_num_batched_tokens=setup.max_num_batched_tokens,
                        async_scheduling=setup.async_scheduling, speculative=setup.speculative,
                        draft_model=path if setup.speculative == "draft" else None,
                        batching=setup.batching, policy="priority", max_wait_ms=0.0)
        greedy = [SamplingParams(max_tokens=min(r.max_tokens, engine.max_model_len - len(r.prompt)), temperature=0.0,
                                 ignore_eos=True) for r in requests]
        reference = [c.token_ids for c in big.generate([r.prompt for r in requests], greedy)]
        expected: dict[str, list[int]] = {}
        for i, (r, params, tokens) in enumerate(zip(requests, greedy, reference)):
            if r.stop_at is not None and r.stop_at < len(tokens):
                stop = tokens[r.stop_at]
                params.stop_token_ids = [stop]
                tokens = tokens[: tokens.index(stop) + 1]
            expected[str(i)] = tokens

        reported: dict[str, list[int]] = {}
        finish: dict[str, str | None] = {}
        num_steps = 0
        while num_steps <= 6 or engine.has_unfinished_requests():
            for i, r in enumerate(requests):
                if r.arrive_at == num_steps:
                    engine.add_request(str(i), r.prompt, greedy[i], priority=r.priority)
                if r.abort_at == num_steps:
                    engine.abort_request(str(i))
            for out in engine.step():
                # Each output adds to what the request reported before: nothing is taken back.
                reported.setdefault(out.request_id, []).extend(out.new_token_ids)
                assert reported[out.request_id] == out.token_ids
                if out.finished:
                    finish[out.request_id] = out.finish_reason
            num_steps += 1
            assert num_steps < 1000
        engine.step()  # the last launched step completes with nothing left to sample
        for request_id, tokens in expected.items():
            got = reported.get(request_id, [])
            if finish.get(request_id) == "abort":
                assert got == tokens[: len(got)], request_id
            else:
                assert got == tokens, (request_id, finish.get(request_id))
        bm = engine.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks and not engine.has_unfinished_requests()
        stats = engine.stats()
        seen["preemptions"] += stats.num_preemptions
        seen["prefix hit tokens"] += stats.prefix_cache_hit_tokens
        seen["accepted proposals"] += stats.spec_accepted_tokens
        seen["aborts"] += sum(reason == "abort" for reason in finish.values())

    run()
    # The examples drove every regime the test is about.
    assert all(seen.values()), seen
