"""Scheduling ahead: each step is launched before the previous step's tokens reach the host, its inputs taken
from the tokens drawn on the device. Every output must be what reading each step's tokens first gives."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from scheduler import SamplingParams
from scheduler.sequence import PENDING_TOKEN
from worker import Engine

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model_path(tiny_model: Callable[..., str]) -> str:
    return tiny_model("llama")


def mixed_requests(vocab_size: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts with every sampling feature that reads the output so far: penalties (counted on the device),
    min_tokens (suppression by the output's length), stop ids and strings, logprobs, seeded draws."""
    rng = random.Random(3)
    features: list[dict[str, object]] = [
        {"temperature": 0.0},
        {"temperature": 0.8, "top_k": 20, "seed": 11},
        {"temperature": 1.0, "top_p": 0.9, "seed": 12, "repetition_penalty": 1.3},
        {"temperature": 0.0, "presence_penalty": 0.7, "frequency_penalty": 0.4},
        {"temperature": 0.7, "seed": 13, "logprobs": 3, "min_p": 0.05},
        {"temperature": 0.0, "min_tokens": 6, "stop_token_ids": [7, 11, 19, 23, 31]},
        {"temperature": 0.9, "seed": 14, "stop": ["a", "e"]},
        {"temperature": 0.0, "logprobs": 2, "repetition_penalty": 1.5},
    ]
    requests = []
    for i in range(24):
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(2, 14))]
        params = SamplingParams(max_tokens=rng.randint(6, 20), **features[i % len(features)])  # type: ignore[arg-type]
        requests.append((prompt, params))
    return requests


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]], abort_at: dict[str, int] | None = None,
        ) -> dict[str, tuple[list[int], str | None, list | None, str]]:
    """Every request to its end through `step`; checks each output as it comes, and that no pending token ever
    shows in one."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    final: dict[str, tuple[list[int], str | None, list | None, str]] = {}
    seen: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for request_id, at in (abort_at or {}).items():
            if at == step:
                engine.abort_request(request_id)
        for out in engine.step():
            assert PENDING_TOKEN not in out.token_ids and PENDING_TOKEN not in out.new_token_ids
            before = seen.get(out.request_id, [])
            assert out.token_ids == before + out.new_token_ids, "an output's tokens only ever grow"
            seen[out.request_id] = out.token_ids
            if out.finished:
                final[out.request_id] = (out.token_ids, out.finish_reason, out.logprobs, out.text)
    engine.step()  # the last launched step, if any, is read with nothing left to sample
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    return final


@pytest.mark.parametrize("settings", [
    {"num_blocks": 256, "max_num_seqs": 8},
    {"num_blocks": 24, "max_num_seqs": 24},  # a small pool: sequences are preempted with a token pending
    {"num_blocks": 256, "max_num_seqs": 6, "max_num_batched_tokens": 10},  # prefills chunked between decodes
])
def test_every_output_is_what_reading_each_step_first_gives(model_path: str, settings: dict[str, int]) -> None:
    ahead = Engine(model=model_path, block_size=BLOCK_SIZE, async_scheduling=True, **settings)
    step_by_step = Engine(model=model_path, block_size=BLOCK_SIZE, async_scheduling=False, **settings)
    assert ahead.schedules_ahead and not step_by_step.schedules_ahead
    requests = mixed_requests(ahead.runner.vocab_size)
    got = run(ahead, requests)
    want = run(step_by_step, requests)
    assert got.keys() == want.keys() == {f"r{i}" for i in range(len(requests))}
    for request_id, (tokens, reason, logprobs, text) in want.items():
        assert got[request_id][0] == tokens, request_id
        assert got[request_id][1] == reason, request_id
        assert got[request_id][3] == text, request_id
        if logprobs is not None:
            assert got[request_id][2] is not None
            assert [e["token_id"] for e in got[request_id][2]] == [e["token_id"] for e in logprobs]
            assert [e["logprob"] for e in got[request_id][2]] == pytest.approx([e["logprob"] for e in logprobs],
                                                                               abs=1e-5)
    if settings["num_blocks"] == 24:
        assert ahead.stats().num_preemptions > 0


def test_aborts_while_a_token_is_pending(model_path: str) -> None:
    """A request aborted while its drawn token is on its way ends with only the tokens read before; the others
    are untouched by it."""
    engine = Engine(model=model_path, block_size=BLOCK_SIZE, num_blocks=128, async_scheduling=True)
    plain = Engine(model=model_path, block_size=BLOCK_SIZE, num_blocks=128, async_scheduling=False)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = [([5, 6, 7], greedy), ([9, 9, 9, 9], greedy), ([1, 2, 3, 4, 5], greedy)]
    want = run(plain, requests)
    got = run(engine, requests, abort_at={"r1": 4})
    assert got["r1"][1] == "abort" and got["r1"][0] == want["r1"][0][: len(got["r1"][0])]
    assert len(got["r1"][0]) < 12
    assert got["r0"] == want["r0"] and got["r2"] == want["r2"]


def test_speculation_reads_each_step_before_the_next(model_path: str) -> None:
    """How many proposed tokens are accepted decides the next step's tokens: with a proposer the engine does not
    schedule ahead, async or not."""
    engine = Engine(model=model_path, block_size=BLOCK_SIZE, num_blocks=64, async_scheduling=True,
                    speculative="ngram")
    assert engine.async_scheduling and not engine.schedules_ahead


def test_an_id_taken_again_while_its_token_is_pending(model_path: str) -> None:
    """A request aborted while its token is drawn and re-added under the same id (a job resumed from the tokens
    it reported, as a worker does) gets its own penalty counts, not the old request's token."""
    penalised = SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)
    want = Engine(model=model_path, block_size=BLOCK_SIZE, num_blocks=64).generate([[5, 6, 7]], penalised)[0]
    for steps_before_abort in (1, 2, 4):
        engine = Engine(model=model_path, block_size=BLOCK_SIZE, num_blocks=64, async_scheduling=True)
        engine.add_request("job", [5, 6, 7], penalised)
        reported: list[int] = []
        for _ in range(steps_before_abort):
            for out in engine.step():
                reported += out.new_token_ids
        engine.abort_request("job")
        engine.add_request("job", [5, 6, 7], penalised, resume_token_ids=reported)
        while engine.has_unfinished_requests():
            for out in engine.step():
                reported += out.new_token_ids
        assert reported == want.token_ids, steps_before_abort


def test_a_failed_launch_leaves_the_engine_whole(model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose launch raises still has the step before it read: the other requests go on, none is left
    with a pending token, and the outputs are those of an undisturbed run."""
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    requests = [([5, 6, 7], greedy), ([1, 2, 3, 4], greedy)]
    want = run(Engine(model=model_path, block_size=BLOCK_SIZE, num_blocks=64), requests)
    engine = Engine(model=model_path, block_size=BLOCK_SIZE, num_blocks=64, async_scheduling=True)
    launch = engine.sampler.launch
    calls = 0

    def fails_once(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("the device went away")
        return launch(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.sampler, "launch", fails_once)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    outputs: dict[str, list[int]] = {}
    for _ in range(2):
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
    with pytest.raises(RuntimeError, match="the device went away"):
        engine.step()
    assert all(seq.num_pending_tokens == 0 for seq in engine.scheduler.running)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
    assert outputs == {request_id: final[0] for request_id, final in want.items()}
