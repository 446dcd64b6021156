"""Speculative decoding gives the tokens decoding without it gives, in every regime of the engine.

The model is a tiny random Llama rewritten by ``bench.repetitive.make_cycling_model`` so that its greedy
continuation follows fixed cycles over the printable ids: its prompts, spans of those cycles with a few
tokens changed, make prompt lookup propose runs that are accepted whole, in part, or not at all. The
transformers greedy reference is computed on the same checkpoint.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.repetitive import successors
from bench.workloads import PRINTABLE_IDS
from scheduler import SamplingParams
from tests.harness.model_reference import transformers_greedy
from worker import Engine
from worker.engine.graph_runner import ReplayCapture
from worker.engine.models.quantization import Quantization
from worker.engine.step_inputs import StepSeq

BLOCK_SIZE = 8
MAX_NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)


def cycle_prompts(num: int, seed: int = 7) -> list[list[int]]:
    """Spans of the model's cycles, 3 to 40 tokens, some with tokens changed (so some proposals fail), and a
    few sharing a 2-block prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    nxt = successors()
    prompts = []
    for i in range(num):
        token = rng.randrange(*PRINTABLE_IDS)
        prompt = [token]
        for _ in range(rng.randint(2, 39)):
            prompt.append(nxt[prompt[-1]])
        for _ in range(i % 3):
            prompt[rng.randrange(len(prompt) - 1)] = rng.randrange(*PRINTABLE_IDS)
        prompts.append(prompt)
    shared = (prompts[0] * 2 * BLOCK_SIZE)[:2 * BLOCK_SIZE]
    return prompts + [shared + p[:5] for p in prompts[:4]]


@pytest.fixture(scope="module")
def reference(cycling_model: str) -> tuple[list[list[int]], list[list[int]]]:
    prompts = cycle_prompts(16)
    return prompts, transformers_greedy(cycling_model, prompts, MAX_NEW_TOKENS)


def run(path: str, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = GREEDY,
        **engine_kwargs: Any) -> tuple[Engine, list[list[int]]]:
    kwargs: dict[str, Any] = {"block_size": BLOCK_SIZE, "num_blocks": 256, "speculative": "ngram", **engine_kwargs}
    engine = Engine(model=path, **kwargs)
    results = engine.generate(prompts, params)
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "every block is back in the pool"
    return engine, [r.token_ids for r in results]


def assert_same(expected: list[list[int]], actual: list[list[int]]) -> None:
    mismatched = [i for i, (e, a) in enumerate(zip(expected, actual)) if e != a]
    assert not mismatched, f"requests {mismatched} differ, first: {expected[mismatched[0]]} vs {actual[mismatched[0]]}"


def assert_speculated(engine: Engine) -> None:
    """Proposals were made, some accepted and some rejected."""
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 0, stats
    assert stats.spec_proposed_tokens > stats.spec_accepted_tokens, stats


REGIMES: dict[str, dict[str, Any]] = {
    "queueing": {"max_num_seqs": 3, "enable_prefix_caching": False},
    "chunked prefill": {"max_num_batched_tokens": 12},
    "preemption": {"num_blocks": 12, "max_num_seqs": 20},
    "prefix hits": {"max_num_seqs": 2},
    "async scheduling": {"async_scheduling": True, "num_blocks": 12, "max_num_seqs": 20},
    "static batching": {"batching": "static", "max_num_seqs": 6},
    "two proposed tokens": {"num_speculative_tokens": 2, "max_num_seqs": 5},
}


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_greedy_ngram_matches_transformers(cycling_model: str, reference: tuple[list[list[int]], list[list[int]]],
                                           regime: str) -> None:
    prompts, expected = reference
    engine, actual = run(cycling_model, prompts, **REGIMES[regime])
    assert_same(expected, actual)
    assert_speculated(engine)
    stats = engine.stats()
    if regime in ("preemption", "async scheduling"):
        assert stats.num_preemptions > 0
    if regime == "prefix hits":
        assert stats.prefix_cache_hit_tokens > 0
    if regime == "chunked prefill":
        assert stats.spec_num_drafts > 0


def test_greedy_ngram_through_the_triton_kernels(cycling_model: str,
                                                 reference: tuple[list[list[int]], list[list[int]]]) -> None:
    """Verification queries (k + 1 tokens over a cached context) through the Triton kernels (CPU interpreter)."""
    prompts, expected = reference
    # Compiled on a CUDA GPU (bench.gpu_check runs this test there), else the interpreter on CPU tensors.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine, actual = run(cycling_model, prompts[:6], attention_backend="triton", max_num_seqs=6, device=device)
    assert_same(expected[:6], actual)
    assert engine.stats().spec_accepted_tokens > 0
    if device == "cuda":  # recorded as CUDA graphs there, by default
        assert engine.runner.num_replayed_verify_steps > 0


@dataclass
class _StepLog:
    """The batches a runner executed, as (tokens, needs_logits) per sequence."""

    steps: list[list[tuple[int, bool]]] = field(default_factory=list)


def _logged(engine: Engine) -> _StepLog:
    """Record every batch the engine's runner executes (the runner's own counters say which it replayed)."""
    log = _StepLog()
    execute = engine.runner.execute

    def logging_execute(batch: list[StepSeq]) -> torch.Tensor:
        log.steps.append([(len(seq.token_ids), seq.needs_logits) for seq in batch])
        return execute(batch)

    engine.runner.execute = logging_execute  # type: ignore[method-assign]
    return log


def _graphed(path: str, **kwargs: Any) -> tuple[Engine, _StepLog]:
    engine = Engine(model=path, block_size=BLOCK_SIZE, num_blocks=64, **{"max_num_seqs": 7, **kwargs})
    assert engine.runner.capture_decode_graphs(ReplayCapture())
    return engine, _logged(engine)


@pytest.mark.parametrize(("proposer", "async_scheduling"), [("ngram", False), ("draft", False), ("ngram", True)])
def test_verify_steps_replay_graphs(cycling_model: str, draft_model: str,
                                    reference: tuple[list[list[int]], list[list[int]]], proposer: str,
                                    async_scheduling: bool) -> None:
    """With graphs recorded (`ReplayCapture`: every replay runs again, forbidding host reads), every step whose
    sequences bring at most 1 + k tokens replays a graph — a verify graph when one of them verifies a
    proposal — and the tokens are the ones decoding without speculation gives, and eager verification gives.
    Batches of 3, 5 or 6 sequences are padded to graphs of 4 and 7; sequences propose fewer than k tokens, or none.
    With async scheduling a step's logits are still read before the next replay overwrites them."""
    prompts, expected = reference
    k = 3
    draft: dict[str, Any] = {"draft_model": draft_model} if proposer == "draft" else {}
    engine, log = _graphed(cycling_model, speculative=proposer, num_speculative_tokens=k,
                           async_scheduling=async_scheduling, **draft)
    runner = engine.runner
    assert runner.graph_sizes == runner.verify_graph_sizes == [1, 2, 4, 7]
    actual = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    assert_same(expected, actual)
    assert_speculated(engine)
    _, eager = run(cycling_model, prompts, speculative=proposer, num_speculative_tokens=k, max_num_seqs=7, **draft)
    assert_same(eager, actual)
    decodes = [s for s in log.steps if all(seq == (1, True) for seq in s)]
    verifies = [s for s in log.steps if s not in decodes and all(n <= 1 + k for n, _ in s)]
    assert runner.num_replayed_verify_steps == len(verifies) > 0
    assert runner.num_replayed_steps == len(decodes) + len(verifies)
    # The verify steps padded batches and sequences: sizes between the graphs', fewer than k proposals, none.
    assert {len(s) for s in verifies} & {3, 5, 6}
    assert any(1 < n < 1 + k for s in verifies for n, _ in s)
    assert any(n == 1 for s in verifies for n, _ in s)


def test_verify_graphs_through_the_triton_kernels(cycling_model: str,
                                                  reference: tuple[list[list[int]], list[list[int]]]) -> None:
    """The Triton attention, its launch settings frozen at recording (CPU interpreter), in replayed verify steps."""
    prompts, expected = reference
    engine, _ = _graphed(cycling_model, speculative="ngram", num_speculative_tokens=2, attention_backend="triton",
                         max_num_seqs=3)
    actual = [r.token_ids for r in engine.generate(prompts[:3], SamplingParams(max_tokens=12, temperature=0.0,
                                                                               ignore_eos=True))]
    assert_same([e[:12] for e in expected[:3]], actual)
    assert engine.runner.num_replayed_verify_steps > 0
    assert engine.stats().spec_accepted_tokens > 0


def test_stops_inside_an_accepted_run(cycling_model: str) -> None:
    """Stop ids, stop strings and max_tokens end the output where decoding without proposals ends it."""
    prompts = cycle_prompts(6, seed=3)
    plain = Engine(model=cycling_model, block_size=BLOCK_SIZE, num_blocks=128)
    free = [c.token_ids for c in plain.generate(prompts, GREEDY)]
    params = []
    for i, tokens in enumerate(free):
        stop_at = tokens[9 + i]
        if i % 3 == 0:
            params.append(SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, stop_token_ids=[stop_at]))
        elif i % 3 == 1:
            text = plain.tokenizer.decode(tokens[7 + i: 9 + i])
            params.append(SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, stop=[text], ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=11 + i, temperature=0.0, ignore_eos=True))
    expected = plain.generate(prompts, params)
    engine = Engine(model=cycling_model, block_size=BLOCK_SIZE, num_blocks=128, speculative="ngram")
    actual = engine.generate(prompts, params)
    for e, a in zip(expected, actual):
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (e.token_ids, e.text, e.finish_reason,
                                                                          e.stop_reason)
        assert len(a.token_ids) < MAX_NEW_TOKENS
    assert engine.stats().spec_accepted_tokens > 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_proposals_a_stop_cuts_are_not_counted_as_accepted(cycling_model: str) -> None:
    """Long runs accepted whole, each cut by a stop three tokens in: the output is what decoding without proposals
    gives, and the accepted count (what the acceptance metrics report) holds only proposals that reached it."""
    prompts = cycle_prompts(6, seed=5)
    plain = Engine(model=cycling_model, block_size=BLOCK_SIZE, num_blocks=128)
    free = [c.token_ids for c in plain.generate(prompts, GREEDY)]
    params = [SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, stop_token_ids=[tokens[2]])
              for tokens in free]
    expected = [c.token_ids for c in plain.generate(prompts, params)]
    engine = Engine(model=cycling_model, block_size=BLOCK_SIZE, num_blocks=128, speculative="ngram",
                    num_speculative_tokens=16)
    actual = [c.token_ids for c in engine.generate(prompts, params)]
    assert actual == expected
    # Every output token is a prefill's, a verify step's own, or an accepted proposal's.
    stats = engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_proposed_tokens > 2 * stats.spec_num_drafts, stats
    assert stats.spec_accepted_tokens <= sum(len(t) for t in actual) - len(prompts), stats


def test_a_job_opts_out(cycling_model: str) -> None:
    prompts = cycle_prompts(4)
    off = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True, speculative=False)
    engine, actual = run(cycling_model, prompts, off)
    assert engine.stats().spec_proposed_tokens == 0
    _, on = run(cycling_model, prompts, GREEDY)
    assert actual == on
    with pytest.raises(ValueError, match="speculative: must be a boolean"):
        SamplingParams.from_dict({"speculative": "no"})


def test_low_acceptance_switches_speculation_off(tiny_model: Callable[..., str], cycling_model: str) -> None:
    """A draft that is always wrong (the cycling model proposing for the random model it was made from): each
    sequence soon stops proposing, for growing pauses, instead of proposing 4 tokens every step."""
    prompts = cycle_prompts(6)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    engine, actual = run(tiny_model("llama"), prompts, params, speculative="draft", draft_model=cycling_model,
                         num_speculative_tokens=4)
    _, plain = run(tiny_model("llama"), prompts, params, speculative=None)
    assert actual == plain
    stats = engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_accepted_tokens < stats.spec_proposed_tokens / 10, stats
    # Proposing 4 tokens at every step would have been 4 * 200 tokens per prompt.
    assert stats.spec_proposed_tokens < 0.05 * 4 * 200 * len(prompts), stats


def test_bad_settings_are_refused(tiny_model: Callable[..., str], tmp_path: Path) -> None:
    path = tiny_model("llama")
    with pytest.raises(ValueError, match="speculative: must be one of"):
        Engine(model=path, num_blocks=8, speculative="medusa")
    with pytest.raises(ValueError, match="draft_model: give a draft model exactly when"):
        Engine(model=path, num_blocks=8, speculative="draft")
    for k in (0, 33, 10**7):  # a huge k would size step buffers (and CUDA verify graphs) for nothing
        with pytest.raises(ValueError, match=r"num_speculative_tokens: must be within \[1, 32\]"):
            Engine(model=path, num_blocks=8, speculative="ngram", num_speculative_tokens=k)
    with pytest.raises(ValueError, match="num_speculative_tokens: only with speculative decoding on"):
        Engine(model=path, num_blocks=8, num_speculative_tokens=5)
    with pytest.raises(ValueError, match="quantization: must be one of int8, fp8 or unset, got 'int4'"):
        Engine(model=path, num_blocks=8, quantization="int4")


@pytest.fixture(scope="module")
def draft_model(tiny_model: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """A one-layer cycling model (same tokenizer) that gets every fifth successor wrong: proposals are accepted
    whole, in part, or not at all."""
    from bench.repetitive import make_cycling_model

    nxt = successors()
    ids = sorted(nxt)
    wrong = {token: ids[(ids.index(nxt[token]) + 7) % len(ids)] for token in ids[::5]}
    return str(make_cycling_model(tiny_model("llama", num_hidden_layers=1), tmp_path_factory.mktemp("draft") / "m",
                                  successor_of={**nxt, **wrong}))


@pytest.mark.parametrize("regime", ["queueing", "chunked prefill", "preemption", "prefix hits", "async scheduling"])
def test_greedy_draft_model_matches_transformers(cycling_model: str, draft_model: str,
                                                 reference: tuple[list[list[int]], list[list[int]]],
                                                 regime: str) -> None:
    prompts, expected = reference
    engine, actual = run(cycling_model, prompts, speculative="draft", draft_model=draft_model, **REGIMES[regime])
    assert_same(expected, actual)
    assert_speculated(engine)
    assert engine.stats().spec_proposer == "draft"
    assert engine.speculator is not None and engine.speculator.draft is not None
    draft = engine.speculator.draft
    # Every request's draft blocks went back when it finished.
    assert draft.block_manager.num_free_blocks == draft.block_manager.num_blocks


def test_the_kv_cache_budget_holds_the_draft_models_cache_too(cycling_model: str, draft_model: str) -> None:
    budget_gb = 0.002
    alone = Engine(model=cycling_model, kv_cache_memory_gb=budget_gb, max_num_seqs=2)
    engine = Engine(model=cycling_model, kv_cache_memory_gb=budget_gb, max_num_seqs=2, speculative="draft",
                    draft_model=draft_model)
    assert engine.speculator is not None and engine.speculator.draft is not None
    target, draft = engine.runner, engine.speculator.draft.runner
    assert draft.num_blocks == target.num_blocks
    budget = int(budget_gb * 2**30)
    # Both caches together fill the budget as the target's cache alone does without a draft.
    assert target.num_blocks * (target.block_bytes + draft.block_bytes) <= budget
    assert (target.num_blocks + 1) * (target.block_bytes + draft.block_bytes) > budget
    assert alone.runner.num_blocks == budget // target.block_bytes > target.num_blocks
    for runner in (target, draft):
        allocated = sum(cache.numel() * cache.element_size() for cache in (*runner.k_caches, *runner.v_caches))
        assert allocated == runner.num_blocks * runner.block_bytes


def test_a_draft_with_a_smaller_embedding_skips_the_tokens_it_lacks(tiny_model: Callable[..., str],
                                                                    draft_model: str) -> None:
    """A draft whose embedding ends before the model's vocabulary (the same tokenizer, as a smaller sibling
    checkpoint can have) cannot read the ids past its end: requests holding one get no proposals, the others
    still speculate, and every output is the model's own."""
    small = tiny_model("llama", num_hidden_layers=1, vocab_size=200, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    target = tiny_model("llama")
    prompts = [[250, 251, 252, 250, 251, 252, 250], *cycle_prompts(3)]
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    engine, actual = run(target, prompts, params, speculative="draft", draft_model=small)
    _, plain = run(target, prompts, params, speculative=None)
    assert_same(plain, actual)
    assert engine.stats().spec_num_drafts > 0
    assert engine.speculator is not None and engine.speculator.draft is not None
    draft = engine.speculator.draft
    assert draft.block_manager.num_free_blocks == draft.block_manager.num_blocks


def test_a_quantized_model_quantizes_its_draft_too(cycling_model: str, draft_model: str) -> None:
    """`--quantization` holds the draft's linear weights as it holds the model's, and the outputs are still
    the quantized model's own."""
    prompts = cycle_prompts(3)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    engine, actual = run(cycling_model, prompts, params, speculative="draft", draft_model=draft_model,
                         quantization="int8")
    _, plain = run(cycling_model, prompts, params, speculative=None, quantization="int8")
    assert_same(plain, actual)
    assert engine.speculator is not None and engine.speculator.draft is not None
    assert engine.speculator.draft.runner.quantization is Quantization.INT8
    assert engine.runner.quantization is Quantization.INT8


def test_a_draft_that_cannot_help_is_named_at_start_up(tiny_model: Callable[..., str],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A draft with a shorter context than the model's proposes nothing past it; one as large as the model
    costs a model step per proposed token. Both run, correctly, and the start-up log says why they will not help."""
    target = tiny_model("llama")
    short = tiny_model("mistral", sliding_window=8, num_hidden_layers=1)
    larger = tiny_model("llama", num_hidden_layers=4)
    with caplog.at_level(logging.WARNING, logger="worker.engine.draft_model"):
        Engine(model=target, num_blocks=16, speculative="draft", draft_model=short)
        Engine(model=target, num_blocks=16, speculative="draft", draft_model=larger)
    lines = [r.getMessage() for r in caplog.records]
    short_line, large_line = lines[0], lines[-1]
    assert len(lines) == 2, lines
    assert "serves 8 tokens of context" in short_line and "get no proposals" in short_line
    assert "as many weight bytes as the model or more" in large_line and larger in large_line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="worker.engine.draft_model"):
        Engine(model=target, num_blocks=16, speculative="draft", draft_model=tiny_model("llama", num_hidden_layers=1))
    assert caplog.records == []
