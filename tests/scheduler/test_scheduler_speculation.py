"""Proposed tokens in the scheduler, without a model: they ride on a decode within the budget and the free
blocks, only accepted ones count as computed, and rejected ones give their blocks back at once."""

from __future__ import annotations

from scheduler import BlockManager, SamplingParams, Scheduler, SchedulerConfig, Sequence

BLOCK_SIZE = 4


def make(num_blocks: int = 16, budget: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=num_blocks * BLOCK_SIZE)
    return Scheduler(config, BlockManager(num_blocks, BLOCK_SIZE))


def decoding(sched: Scheduler, request_id: str, prompt: list[int]) -> Sequence:
    """A sequence prefilled and given its first token, so it decodes next."""
    seq = Sequence(request_id, prompt, SamplingParams(max_tokens=32))
    sched.add(seq)
    out = sched.schedule()
    sched.advance(out, {s.seq.request_id: [9] for s in out.scheduled if s.is_sampling})
    assert seq.num_uncomputed_tokens == 1
    return seq


def test_proposal_rides_on_the_decode_and_rejected_blocks_go_back() -> None:
    sched = make()
    bm = sched.block_manager
    seq = decoding(sched, "a", [1, 2, 3])  # 4 tokens: one full block
    seq.spec_token_ids = [5, 6, 7, 8, 9]
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.num_new_tokens == 6 and s.spec_token_ids == [5, 6, 7, 8, 9]
    assert s.token_ids == [9, 5, 6, 7, 8, 9] and s.is_sampling
    assert len(seq.block_table) == 3  # positions 0..9
    free_before = bm.num_free_blocks
    sched.advance(out, {"a": [5, 4]})  # one proposal accepted, then the model's own token
    assert seq.output_token_ids == [9, 5, 4]
    assert seq.num_computed_tokens == 5  # the 4 known tokens and the accepted proposal
    assert len(seq.block_table) == 2 and bm.num_free_blocks == free_before + 1
    assert len(seq.block_hashes) == 1, "only the full block of computed tokens is hashed"
    assert seq.spec_token_ids == []
    bm.check_invariants()


def test_proposal_is_trimmed_to_the_budget_and_the_free_blocks_never_preempting() -> None:
    sched = make(num_blocks=3, budget=4)
    a = decoding(sched, "a", [1, 2, 3])
    a.spec_token_ids = [5, 6, 7, 8, 9, 10]
    (s,) = sched.schedule().scheduled
    assert s.num_new_tokens == 4 and s.spec_token_ids == [5, 6, 7], "the budget of 4 holds 3 proposals"
    sched = make(num_blocks=3, budget=64)
    a = decoding(sched, "a", [1, 2, 3])
    decoding(sched, "b", [4, 5])
    assert sched.block_manager.num_free_blocks == 1
    a.spec_token_ids = [5, 6, 7, 8, 9, 10]
    out = sched.schedule()
    by_id = {s.seq.request_id: s for s in out.scheduled}
    # One free block: room for a's decode token and three proposals; b is not preempted for more.
    assert by_id["a"].spec_token_ids == [5, 6, 7] and "b" in by_id and not out.preempted


def test_preemption_drops_the_proposal() -> None:
    sched = make(num_blocks=2, budget=64)
    a = decoding(sched, "a", [1, 2, 3])
    b = decoding(sched, "b", [5, 6, 7])  # a decoded alongside: its next token opens a second block
    assert sched.block_manager.num_free_blocks == 0
    b.spec_token_ids = [1, 2]
    out = sched.schedule()
    # a needs a block: the latest admitted, b, is preempted, its proposal with it.
    assert out.preempted == [b] and b.spec_token_ids == []
    assert [s.seq for s in out.scheduled] == [a]
