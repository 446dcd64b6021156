"""Greedy engine output is token-for-token what transformers `generate` gives.

One set of 32 prompts per architecture (lengths 1 to several blocks, half of
them sharing a long prefix) is run through transformers one prompt at a time,
without padding, then through the engine in each batching regime.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from transformers import AutoConfig

from scheduler import SamplingParams
from tests.harness.model_reference import transformers_greedy
from worker import Engine
from worker.engine.graph_runner import ReplayCapture

# qwen3 and the Llama family run carpool's own models; phi and gpt2, outside it, run through transformers.
ARCHS = ["llama", "qwen2", "mistral", "qwen3", "phi", "gpt2"]
NUM_REQUESTS = 32
MAX_NEW_TOKENS = 10
BLOCK_SIZE = 8
SHARED_PREFIX_LEN = 3 * BLOCK_SIZE
LONGEST_PROMPT = 5 * BLOCK_SIZE + 3
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)


def make_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(1234)
    lengths = [1, 2, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, LONGEST_PROMPT]
    lengths += [rng.randint(1, LONGEST_PROMPT) for _ in range(NUM_REQUESTS // 2 - len(lengths))]
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]
    shared = [rng.randrange(vocab_size) for _ in range(SHARED_PREFIX_LEN)]
    for i in range(NUM_REQUESTS // 2):
        # Suffix lengths 0.. so some prompts are exactly the prefix (never a full hit).
        prompts.append(shared + [rng.randrange(vocab_size) for _ in range(i % (BLOCK_SIZE + 3))])
    return prompts


@pytest.fixture(scope="module", params=ARCHS)
def reference(request: pytest.FixtureRequest, tiny_model: Callable[..., str]) -> tuple[str, list[list[int]], list[list[int]]]:
    """(model path, prompts, transformers greedy outputs) for one architecture."""
    path = tiny_model(request.param)
    prompts = make_prompts(AutoConfig.from_pretrained(path).vocab_size)
    outputs = transformers_greedy(path, prompts, MAX_NEW_TOKENS)
    assert all(len(o) == MAX_NEW_TOKENS for o in outputs)
    return path, prompts, outputs


def run_engine(path: str, prompts: list[list[int]], **engine_kwargs: object) -> tuple[Engine, list[list[int]]]:
    kwargs: dict[str, object] = {"block_size": BLOCK_SIZE, "num_blocks": 256, **engine_kwargs}
    engine = Engine(model=path, **kwargs)  # type: ignore[arg-type]
    results = engine.generate(prompts, GREEDY)
    assert all(r.finish_reason == "length" for r in results)
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "every block is back in the pool"
    assert not engine.has_unfinished_requests()
    return engine, [r.token_ids for r in results]


def assert_same(expected: list[list[int]], actual: list[list[int]]) -> None:
    mismatched = [i for i, (e, a) in enumerate(zip(expected, actual)) if e != a]
    assert not mismatched, f"requests {mismatched} differ, first: {expected[mismatched[0]]} vs {actual[mismatched[0]]}"


def test_fewer_slots_than_requests(reference: tuple[str, list[list[int]], list[list[int]]]) -> None:
    path, prompts, expected = reference
    engine, actual = run_engine(path, prompts, max_num_seqs=6, enable_prefix_caching=False)
    assert_same(expected, actual)
    assert engine.stats().num_steps >= NUM_REQUESTS * MAX_NEW_TOKENS // 6


def test_kv_pool_too_small_preempts(reference: tuple[str, list[list[int]], list[list[int]]]) -> None:
    path, prompts, expected = reference
    # 20 blocks of 8 tokens hold the longest request alone (7 blocks) but not all 32 at once.
    engine, actual = run_engine(path, prompts, num_blocks=20, max_num_seqs=NUM_REQUESTS)
    assert_same(expected, actual)
    assert engine.stats().num_preemptions > 0


def test_chunked_prefill(reference: tuple[str, list[list[int]], list[list[int]]]) -> None:
    path, prompts, expected = reference
    budget = 12
    assert budget < LONGEST_PROMPT
    engine = Engine(model=path, block_size=BLOCK_SIZE, num_blocks=256, max_num_batched_tokens=budget)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    tokens: dict[str, list[int]] = {}
    max_step_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
        max_step_tokens = max(max_step_tokens, engine.stats().last_step_num_tokens)
    # No step computed more than the budget, so the longest prompt went in chunks.
    assert max_step_tokens == budget
    assert_same(expected, [tokens[str(i)] for i in range(len(prompts))])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_shared_prefix_hits_the_cache(reference: tuple[str, list[list[int]], list[list[int]]]) -> None:
    path, prompts, expected = reference
    # Few slots: later prompts arrive after the shared prefix has been computed and cached.
    engine, actual = run_engine(path, prompts, max_num_seqs=4)
    assert_same(expected, actual)
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens >= SHARED_PREFIX_LEN
    assert stats.prefix_cache_hit_tokens % BLOCK_SIZE == 0
    # A second run of the same prompts is served largely from the cache, with the same tokens.
    again = engine.generate(prompts, GREEDY)
    assert_same(expected, [r.token_ids for r in again])
    assert sum(r.num_cached_tokens for r in again) > stats.prefix_cache_hit_tokens


@pytest.mark.parametrize("batching", ["static", "dynamic"])
def test_static_and_dynamic_batching_give_the_same_tokens(
    reference: tuple[str, list[list[int]], list[list[int]]], batching: str
) -> None:
    path, prompts, expected = reference
    engine, actual = run_engine(path, prompts, batching=batching, max_num_seqs=8, max_wait_ms=1.0)
    assert_same(expected, actual)


def _replayed_tokens(path: str, prompts: list[list[int]], attention_backend: str) -> tuple[Engine, list[list[int]]]:
    engine = Engine(model=path, block_size=BLOCK_SIZE, num_blocks=20, max_num_seqs=12,
                    attention_backend=attention_backend)
    assert engine.runner.capture_decode_graphs(ReplayCapture())
    assert engine.runner.graph_sizes == [1, 2, 4, 8, 12]
    tokens = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    assert engine.runner.num_replayed_steps > 0
    return engine, tokens


def test_replayed_decode_steps_give_the_same_tokens(reference: tuple[str, list[list[int]], list[list[int]]]) -> None:
    """Decode steps recorded once per padded batch size and replayed, as CUDA graphs are, with preemptions.

    The CPU capture backend runs each replay again with the arguments it was
    recorded with and fails on any host read, so a replay that read a value
    it should have taken from the step buffers would fail or give other tokens.
    """
    path, prompts, expected = reference
    engine, actual = _replayed_tokens(path, prompts, "torch")
    assert_same(expected, actual)
    assert engine.stats().num_preemptions > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_replayed_decode_steps_with_the_triton_kernels(tiny_model: Callable[..., str], arch: str) -> None:
    """The same through the Triton kernels (under the CPU interpreter here: a few prompts, two architectures)."""
    path = tiny_model(arch)
    prompts = make_prompts(AutoConfig.from_pretrained(path).vocab_size)[::5][:6]
    expected = transformers_greedy(path, prompts, MAX_NEW_TOKENS)
    assert_same(expected, _replayed_tokens(path, prompts, "triton")[1])


@pytest.mark.parametrize("regime", ["preemption", "chunked prefill", "prefix hits", "static"])
def test_async_scheduling_gives_the_same_tokens(
    reference: tuple[str, list[list[int]], list[list[int]]], regime: str
) -> None:
    """The next step is scheduled and launched before this one's tokens are checked for stops."""
    path, prompts, expected = reference
    settings: dict[str, object] = {
        "preemption": {"num_blocks": 20, "max_num_seqs": NUM_REQUESTS},
        "chunked prefill": {"max_num_batched_tokens": 12},
        "prefix hits": {"max_num_seqs": 4},
        "static": {"batching": "static", "max_num_seqs": 8, "max_wait_ms": 1.0},
    }[regime]
    engine, actual = run_engine(path, prompts, async_scheduling=True, **settings)
    assert engine.async_scheduling
    assert_same(expected, actual)
    if regime == "preemption":
        assert engine.stats().num_preemptions > 0


def test_async_scheduling_aborts_and_stops_cleanly(tiny_model: Callable[..., str]) -> None:
    """A request aborted, or stopped by a stop token, while its next step is in flight gets no extra token."""
    path = tiny_model("llama")
    engine = Engine(model=path, block_size=BLOCK_SIZE, num_blocks=64, async_scheduling=True)
    plain = Engine(model=path, block_size=BLOCK_SIZE, num_blocks=64, async_scheduling=False)
    free = GREEDY
    first = plain.generate([[5, 6, 7]], free)[0].token_ids
    stop_at = first[3]
    stopping = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, stop_token_ids=[stop_at])
    engine.add_request("stops", [5, 6, 7], stopping)
    engine.add_request("aborted", [9, 9, 9, 9], free)
    engine.add_request("runs", [5, 6, 7], free)
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str | None] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
            if out.finished:
                finish[out.request_id] = out.finish_reason
        steps += 1
        if steps == 3:
            engine.abort_request("aborted")
    assert outputs["stops"] == first[: first.index(stop_at) + 1]
    assert finish["stops"] == "stop"
    assert finish["aborted"] == "abort" and len(outputs["aborted"]) <= 2
    assert outputs["runs"] == first and finish["runs"] == "length"
    engine.step()  # the last launched step completes with nothing left to sample
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
