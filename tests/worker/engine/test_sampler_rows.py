"""The sampler's device rows: penalty counts kept step by step, rows freed and reused, one host copy per step."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from scheduler.params import SamplingParams
from worker.engine.penalties import apply_penalties, penalise_rows
from worker.engine.sampler import SampleRequest, Sampler

VOCAB = 16  # small enough that logprobs=16 reports the whole distribution


def _full_distribution(sampler: Sampler, logits: torch.Tensor, requests: list[SampleRequest]) -> list[dict[int, float]]:
    """Each row's log-softmax as the sampler reports it (greedy rows with logprobs over the whole vocab)."""
    tokens = sampler.sample(logits, requests)
    assert all(t.top_logprobs is not None for t in tokens)
    return [t.top_logprobs or {} for t in tokens]


def _reference(logits: torch.Tensor, requests: list[SampleRequest]) -> list[dict[int, float]]:
    """The same through the per-row penalty loop and plain suppression."""
    rows = []
    for row, request in zip(logits.clone(), requests):
        if request.params.has_penalties:
            apply_penalties(row, request)
        row[request.suppress_token_ids] = float("-inf")
        values = row.log_softmax(-1)
        rows.append({t: v for t, v in enumerate(values.tolist()) if v != float("-inf")})
    return rows


def _mixed_requests(rng: random.Random) -> list[SampleRequest]:
    choices: list[dict[str, Any]] = [
        {},
        {"repetition_penalty": 1.7},
        {"presence_penalty": 0.6, "frequency_penalty": -0.35},
        {"repetition_penalty": 0.8, "frequency_penalty": 1.25, "presence_penalty": -1.5},
    ]
    return [
        SampleRequest(
            f"q{i}", SamplingParams(temperature=0.0, logprobs=VOCAB, **choices[i % 4]),
            [rng.randrange(VOCAB) for _ in range(rng.randint(0, 6))], [], 10, [],
        )
        for i in range(8)
    ]


def test_penalties_from_count_tensors_equal_the_per_row_loop_step_after_step() -> None:
    rng = random.Random(5)
    requests = _mixed_requests(rng)
    sampler = Sampler(VOCAB, max_num_seqs=4)  # fewer rows than requests: the rows grow
    for step in range(6):
        logits = torch.randn(len(requests), VOCAB, generator=torch.Generator().manual_seed(step))
        for r in requests:
            r.suppress_token_ids = [step % VOCAB] if step < 2 else []
        assert _full_distribution(sampler, logits, requests) == _reference(logits, requests)
        # The engine appends each sampled (greedy) token; one request is resumed with other tokens.
        for r, t in zip(requests, logits.argmax(-1).tolist()):
            r.output_token_ids.append(t)
            r.position += 1
        if step == 3:
            requests[1].output_token_ids[-1] = (requests[1].output_token_ids[-1] + 1) % VOCAB
            requests[2].output_token_ids = [3, 3, 3]


def test_penalise_rows_equals_apply_penalties_and_leaves_unpenalised_rows_bit_for_bit() -> None:
    rng = random.Random(2)
    requests = _mixed_requests(rng)
    for r in requests:
        r.output_token_ids = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 9))]
    logits = torch.randn(len(requests), VOCAB, generator=torch.Generator().manual_seed(9)) * 4
    seen = torch.zeros(len(requests), VOCAB, dtype=torch.bool)
    counts = torch.randint(0, 5, (len(requests), VOCAB), dtype=torch.int32)  # stale rows hold anything
    for i, r in enumerate(requests):
        if r.params.has_penalties:
            seen[i] = False
            seen[i, r.prompt_token_ids] = True
            counts[i] = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.long), minlength=VOCAB)

    def column(name: str) -> torch.Tensor:
        return torch.tensor([[getattr(r.params, name)] for r in requests], dtype=torch.float32)

    batched = penalise_rows(
        logits, seen, counts, column("repetition_penalty"), column("presence_penalty"), column("frequency_penalty")
    )
    expected = logits.clone()
    for row, r in zip(expected, requests):
        apply_penalties(row, r)
    assert torch.equal(batched, expected)


def test_a_seeded_penalised_request_resumes_with_the_same_tokens() -> None:
    params = SamplingParams(temperature=1.0, seed=77, repetition_penalty=1.3, frequency_penalty=0.4)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1)) * 0.3

    def run(sampler: Sampler, output: list[int], num_steps: int) -> list[int]:
        request = SampleRequest("s", params, [1, 2, 3], output, 3 + len(output), [])
        for _ in range(num_steps):
            output.append(sampler.sample(logits, [request])[0].token_id)
            request.position += 1
        return output

    straight = run(Sampler(VOCAB, seed=1), [], 12)
    assert len(set(straight)) > 3  # really random
    resumed = run(Sampler(VOCAB, seed=2), straight[:5], 7)
    assert resumed == straight


def test_released_and_evicted_rows_are_reused_without_leaking_state() -> None:
    """With two rows, three penalised requests take turns; one vanishes unreleased, one id is reused."""
    sampler = Sampler(VOCAB, max_num_seqs=2)
    rng = random.Random(8)
    requests = {
        name: SampleRequest(name, SamplingParams(temperature=0.0, logprobs=VOCAB, frequency_penalty=0.9), [], [], 0, [])
        for name in "abc"
    }
    for step in range(12):
        name = "abc"[step % 3] if step < 9 else "ab"[step % 2]
        request = requests[name]
        logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(step))
        assert _full_distribution(sampler, logits, [request]) == _reference(logits, [request])
        request.output_token_ids.append(rng.randrange(VOCAB))  # any token the engine appended
        if step == 4:
            sampler.release("a")
        if step == 6:  # "b" ends, a new request takes its id
            requests["b"] = SampleRequest("b", SamplingParams(temperature=0.0, logprobs=VOCAB, repetition_penalty=2.0), [4], [], 0, [])


def test_greedy_and_sampled_rows_share_one_batch() -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(6))
    seeded = SampleRequest("s", SamplingParams(temperature=0.9, seed=3, top_p=0.9), [], [], 12, [])
    alone = Sampler(300).sample(logits[1:2], [seeded])[0].token_id
    greedy = [SampleRequest(f"g{i}", SamplingParams(temperature=0.0), [], [], 5, [9] if i else []) for i in range(3)]
    tokens = [t.token_id for t in Sampler(300).sample(logits, [greedy[0], seeded, greedy[1], greedy[2]])]
    masked = logits.clone()
    masked[2:, 9] = float("-inf")
    assert tokens[1] == alone
    assert [tokens[0], tokens[2], tokens[3]] == masked[[0, 2, 3]].argmax(-1).tolist()


class _HostReads(TorchFunctionMode):
    """Records every call that makes the host wait for a tensor's values."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        name = getattr(func, "__name__", "")
        if name in {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero"}:
            self.reads.append(name)
        # A boolean mask as an index has a data-dependent size: a sync on an accelerator.
        if name in {"__getitem__", "__setitem__"}:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                self.reads.append(f"{name}[mask]")
        return func(*args, **(kwargs or {}))


def test_the_mode_sees_host_reads() -> None:
    t = torch.ones(3)
    with _HostReads() as mode:
        bool(t[0] > 0), t.sum().item(), t[t > 0], t.tolist()
    assert mode.reads == ["__bool__", "item", "__getitem__[mask]", "tolist"]


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_sample_reads_the_device_once_per_step(with_logprobs: bool) -> None:
    sampler = Sampler(300, max_num_seqs=4)
    logprobs = 3 if with_logprobs else None
    requests = [
        SampleRequest("greedy", SamplingParams(temperature=0.0, logprobs=logprobs), [1], [], 1, [0, 5]),
        SampleRequest("seeded", SamplingParams(temperature=0.8, seed=4, top_k=20, min_p=0.05), [2], [], 1, []),
        SampleRequest("free", SamplingParams(temperature=1.2, top_p=0.9), [3], [], 1, [7]),
        SampleRequest("penalised", SamplingParams(repetition_penalty=1.2, presence_penalty=0.5), [4, 4], [], 1, []),
        SampleRequest("new", SamplingParams(), [5], [], 1, []),  # a fifth row: the rows grow
    ]
    for step in range(3):
        logits = torch.randn(len(requests), 300, generator=torch.Generator().manual_seed(step))
        with _HostReads() as mode:
            tokens = sampler.sample(logits, requests)
        assert mode.reads == ["tolist"], mode.reads
        for r, t in zip(requests, tokens):
            r.output_token_ids.append(t.token_id)
            r.position += 1


def test_a_step_of_the_same_requests_reuses_the_last_steps_rows_and_any_change_makes_them_anew() -> None:
    """Step after step with the same request objects (the engine's decode steps), then with their order changed,
    one released and sampled again (a preempted request readmitted), one left out, one released and its id reused
    with other parameters, and one given other parameters in place: each step's seeded and greedy tokens are those of a fresh sampler given fresh copies of the requests."""
    vocab = 64
    requests = [
        SampleRequest("greedy", SamplingParams(temperature=0.0), [1], [], 3, []),
        SampleRequest("hot", SamplingParams(temperature=1.5, seed=11), [2], [], 3, []),
        SampleRequest("filtered", SamplingParams(temperature=0.7, seed=12, top_k=5), [3], [], 3, []),
        SampleRequest("penalised", SamplingParams(temperature=0.0, repetition_penalty=3.0), [4, 5], [], 3, []),
    ]
    sampler = Sampler(vocab, max_num_seqs=4)
    for step in range(10):
        if step == 3:
            requests = [requests[2], requests[0], requests[3], requests[1]]
        if step == 4:
            sampler.release("penalised")
        if step == 5:
            requests = requests[1:]
        if step == 6:
            sampler.release("hot")
            requests[-1] = SampleRequest("hot", SamplingParams(temperature=0.0, frequency_penalty=2.0), [6], [], 3, [])
        if step == 8:
            requests[0].params = SamplingParams(temperature=1.0, seed=99, min_p=0.2)
        logits = torch.randn(len(requests), vocab, generator=torch.Generator().manual_seed(step)) * 3
        tokens = [t.token_id for t in sampler.sample(logits, requests)]
        copies = [SampleRequest(r.request_id, r.params, list(r.prompt_token_ids), list(r.output_token_ids),
                                r.position, list(r.suppress_token_ids)) for r in requests]
        assert tokens == [t.token_id for t in Sampler(vocab).sample(logits, copies)], step
        for r, t in zip(requests, tokens):
            r.output_token_ids.append(t)
            r.position += 1
